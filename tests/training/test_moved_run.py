"""A run directory moved or renamed while interrupted resumes where it is now (its recipe.yaml still names the old
output.dir), rather than refusing with "output.dir differ" and advising --force, which would delete it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import adapter_weights, interrupt_on_step, recipe_file

from delft import rundir
from delft.recipe.files import load_recipe
from delft.training.stages import run_training


@pytest.mark.slow
def test_a_moved_run_resumes_from_its_new_place(tmp_path, tiny_model_dir, monkeypatch, capsys):
    straight = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight")))
    path = recipe_file(tmp_path, tiny_model_dir, name="run")
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    old, new = tmp_path / "run", tmp_path / "moved" / "renamed"
    new.parent.mkdir()
    shutil.move(old, new)
    restore()
    capsys.readouterr()

    run_training(load_recipe(path, [f"output.dir={new}"]))
    said = "".join(capsys.readouterr().out.split())
    assert f"Resumingfrom{new}/checkpoints/step-000004" in said and f"wastrainedas{old}" in said  # rich wraps
    assert not old.exists()
    info = json.loads((new / rundir.RUN_INFO).read_text())
    assert info["status"] == rundir.COMPLETED and info["step"] == 6
    assert load_recipe(new / rundir.RECIPE).output.dir == str(new)  # the run now names where it is
    steps = [json.loads(ln)["step"] for ln in (new / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(ln)]
    assert steps == [1, 2, 3, 4, 5, 6]
    a, b = adapter_weights(straight), adapter_weights(new)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)  # the same run as an unmoved one
