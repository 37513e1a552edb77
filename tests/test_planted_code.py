"""Files from others are data, never code: a pickled object planted in a checkpoint, and model code shipped in a
run's base (``auto_map``) with the run's recipe saying ``trust_remote_code: true``. Each attack is planted for real;
each test asserts that no code ran, that nothing was deleted or written, and what delft said."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import adapter_weights, interrupt_on_step, lora_run, recipe_file, run_cli

from delft.recipe.files import load_recipe
from delft.rundir import RECIPE, RUN_INFO, STATE_FILE, latest_checkpoint
from delft.training.stages import run_training


class Planted:
    """Unpickling this runs ``touch SENTINEL``: what an attacker puts in a shared run's trainer_state.pt."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def tree(path: Path) -> dict:
    """Every file under ``path`` with its bytes: what "nothing changed" is compared on."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_pickled_object_in_a_checkpoint_is_refused_and_never_run(tmp_path, tiny_model_dir, monkeypatch):
    straight = adapter_weights(run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight"))))
    path = recipe_file(tmp_path, tiny_model_dir, name="shared")
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    restore()
    run = tmp_path / "shared"
    state_file = latest_checkpoint(run) / STATE_FILE
    honest = state_file.read_bytes()
    state = torch.load(state_file, weights_only=True)
    sentinel = tmp_path / "code-ran"
    state["extra"] = {"tracker": Planted(sentinel)}  # a real state, with one planted object inside
    torch.save(state, state_file)
    before = tree(run)

    result = run_cli("train", path)
    assert result.exit_code == 2, result.output
    assert not sentinel.exists()
    said = " ".join(result.output.split())
    assert "holds Python objects" in said and "was not loaded and nothing was deleted" in said
    assert str(latest_checkpoint(run)) in said.replace("\n", "")
    assert "Traceback" not in result.output
    assert tree(run) == before  # no checkpoint deleted, no metrics truncated, no run info rewritten

    state_file.write_bytes(honest)  # the owner's own file back: the run resumes to the uninterrupted result
    assert run_cli("train", path).exit_code == 0
    got = adapter_weights(run)
    for k in straight:
        torch.testing.assert_close(got[k], straight[k], atol=1e-6, rtol=1e-5)


def test_every_state_delft_writes_loads_as_data_only(tmp_path, tiny_model_dir, monkeypatch):
    """The optimizer, scheduler, RNG and early-stopping states of a real checkpoint pass weights_only=True (so the
    refusal above never hits an honest run)."""
    path = recipe_file(tmp_path, tiny_model_dir, train={"save_steps": 2, "eval_steps": 2,
                                                         "early_stopping": {"patience": 3}})
    interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts
    for ckpt in ckpts:
        state = torch.load(ckpt / STATE_FILE, weights_only=True)
        assert state["optimizer"]["state"] and state["extra"]["tracker"]["patience"] == 3


def evil_base(tmp_path: Path, tiny_model_dir: Path, model_type: str) -> tuple[Path, Path]:
    """A copy of the tiny model whose config names code of its own (``auto_map``): importing it touches a file."""
    base = tmp_path / "evil-base"
    shutil.copytree(tiny_model_dir, base)
    sentinel = tmp_path / "remote-code-ran"
    code = f"import pathlib\npathlib.Path({str(sentinel)!r}).touch()\n"
    (base / "configuration_evil.py").write_text(code + "from transformers import LlamaConfig\n\n\n"
                                                "class EvilConfig(LlamaConfig):\n    pass\n")
    (base / "modeling_evil.py").write_text(code + "from transformers import LlamaForCausalLM\n\n"
                                           "from .configuration_evil import EvilConfig\n\n\n"
                                           "class EvilForCausalLM(LlamaForCausalLM):\n"
                                           "    config_class = EvilConfig\n")
    config = json.loads((base / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                   "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (base / "config.json").write_text(json.dumps(config))
    return base, sentinel


def downloaded_adapter(tmp_path: Path, tiny_model_dir: Path, base: Path) -> Path:
    """An adapter folder as someone shares it: trained on the tiny model, its run info pointing at ``base``, its
    recipe asking for trust_remote_code."""
    run = lora_run(tiny_model_dir, tmp_path / "downloaded")
    info = json.loads((run / RUN_INFO).read_text())
    info["base_model"] = str(base)
    (run / RUN_INFO).write_text(json.dumps(info))
    recipe = yaml.safe_load((run / RECIPE).read_text())
    recipe["model"].update(name=str(base), trust_remote_code=True)
    (run / RECIPE).write_text(yaml.safe_dump(recipe))
    return run


def test_export_refuses_a_base_that_needs_its_own_code_whatever_the_run_says(tmp_path, tiny_model_dir):
    base, sentinel = evil_base(tmp_path, tiny_model_dir, model_type="evil")  # transformers has no class for it
    run = downloaded_adapter(tmp_path, tiny_model_dir, base)
    out = tmp_path / "merged"
    result = run_cli("export", run, "--out", out)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "configuration_evil.py, modeling_evil.py" in said and str(base) in said
    assert "--trust-remote-code" in said and "Traceback" not in result.output
    assert not sentinel.exists() and not out.exists()
    result = run_cli("eval", run, "--data", "synthetic", "--limit", "1")  # the same base through eval: refused
    assert result.exit_code == 2 and "modeling_evil.py" in " ".join(result.output.split()), result.output
    assert not sentinel.exists()


def test_export_loads_transformers_own_classes_when_the_run_asks_for_remote_code(tmp_path, tiny_model_dir):
    """A known model_type with auto_map: the run's trust_remote_code: true used to run the shipped code; now the
    export merges with transformers' own Llama classes, and the code runs only with the user's flag."""
    base, sentinel = evil_base(tmp_path, tiny_model_dir, model_type="llama")
    run = downloaded_adapter(tmp_path, tiny_model_dir, base)
    result = run_cli("export", run, "--out", tmp_path / "merged", "--dtype", "float32", "--no-gguf-check")
    assert result.exit_code == 0, result.output
    assert not sentinel.exists()
    result = run_cli("export", run, "--out", tmp_path / "trusted", "--dtype", "float32", "--no-gguf-check",
                     "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert sentinel.exists()  # the user's own command line is the one place that can allow it
