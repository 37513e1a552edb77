"""Checkpoints are ordered by their step, not their name: past step 999,999 ``step-1000000`` sorts before
``step-999000`` by name, and a resume went back to the older one while the keep rule deleted the newer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import interrupt_on_step, recipe_file

from delft import rundir
from delft.recipe.files import load_recipe
from delft.training.stages import run_training


def _checkpoint(run_dir, name: str):
    path = rundir.checkpoints_root(run_dir) / name
    path.mkdir(parents=True)
    (path / rundir.STATE_FILE).write_bytes(b"")
    return path


def test_checkpoints_are_listed_by_step(tmp_path):
    for name in ("step-1000000", "step-999000", "step-000042", "step-10000000"):
        _checkpoint(tmp_path, name)
    (rundir.checkpoints_root(tmp_path) / "step-5").mkdir()  # no state file: a half-made one, not listed
    (rundir.checkpoints_root(tmp_path) / "step-notes").mkdir()  # no step number: not a checkpoint
    _checkpoint(tmp_path, "step-x1")
    found = rundir.checkpoints(tmp_path)
    assert [c.name for c in found] == ["step-000042", "step-999000", "step-1000000", "step-10000000"]
    assert [rundir.checkpoint_step(c) for c in found] == [42, 999_000, 1_000_000, 10_000_000]
    assert rundir.latest_checkpoint(tmp_path).name == "step-10000000"
    assert rundir.checkpoint_path(tmp_path, 1_000_000).name == "step-1000000"


@pytest.mark.slow
def test_a_run_past_step_999999_resumes_from_its_newest_checkpoint_and_keeps_it(tmp_path, tiny_model_dir,
                                                                                 monkeypatch):
    path = recipe_file(tmp_path, tiny_model_dir, train={"save_steps": 2, "keep_checkpoints": 2})
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    run_dir = tmp_path / "run"
    real = rundir.checkpoint_path(run_dir, 4)
    # the run's own step-4 checkpoint renumbered as if it had reached step 999,000 and then 1,000,000
    for step in (999_000, 1_000_000):
        moved = rundir.checkpoint_path(run_dir, step)
        shutil.copytree(real, moved)
        state = torch.load(moved / rundir.STATE_FILE, weights_only=True)
        torch.save({**state, "step": step}, moved / rundir.STATE_FILE)
    for old in (2, 4):
        shutil.rmtree(rundir.checkpoint_path(run_dir, old))

    restore()
    interrupt_on_step(monkeypatch, 2)  # the resumed run saves step 1,000,001 and stops
    with pytest.raises(SystemExit):
        run_training(load_recipe(path, ["train.max_steps=1000010", "train.save_steps=1"]))
    # keep_checkpoints 2: the two newest by step stay, step-999000 goes (by name step-1000000 was deleted)
    assert [c.name for c in rundir.checkpoints(run_dir)] == ["step-1000000", "step-1000001"]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 1_000_001  # trained on from 1,000,000, not 999,000
    assert json.loads((run_dir / rundir.RUN_INFO).read_text())["step"] == 1_000_001
