"""train.accuracy_steps: held-out greedy exact match while training equals delft eval on the same slice."""

import json

import pytest
from helpers import recipe_file
from rich.console import Console

from delft.errors import UserError
from delft.evaluation.command import run_eval
from delft.recipe.files import load_recipe
from delft.training.stages import run_training


def test_accuracy_rows_at_their_steps_equal_eval(tmp_path, digit_model_path):
    path = recipe_file(tmp_path, digit_model_path, train={"max_steps": 7, "accuracy_steps": 3,
                                                          "accuracy_examples": 6},
                       eval={"max_new_tokens": 4, "batch_size": 4, "bootstrap": 0})
    run = run_training(load_recipe(path), console=Console(width=160))
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r for r in rows if "accuracy" in r]
    assert [r["step"] for r in accuracy] == [3, 6, 7]  # every 3 steps and at the end
    assert all(r["accuracy_n"] == 6 and 0 <= r["accuracy"] <= 1 for r in accuracy)
    assert all("loss" not in r for r in accuracy) and sum("loss" in r for r in rows) == 7
    assert len({r["digit_accuracy"] for r in accuracy}) > 1  # the answers move as the adapter trains
    assert (run / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"

    results = run_eval(recipe_path=path, limit=6, include_base=False, console=Console(width=160))
    m = results[0].metrics
    assert m["n"] == 6
    last = accuracy[-1]
    assert (last["accuracy"], last["tolerance_accuracy"], last["digit_accuracy"]) == \
        (m["exact_match"], m["tolerance_match"], m["digit_accuracy"])


def test_accuracy_is_off_by_default_and_checked(tmp_path, tiny_model_dir):
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 2})))
    assert not any("accuracy" in json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines())
    with pytest.raises(UserError, match="train.accuracy_examples"):
        load_recipe(recipe_file(tmp_path, tiny_model_dir, name="bad", train={"accuracy_examples": 0}))
    with pytest.raises(UserError, match="train.accuracy_steps"):
        load_recipe(recipe_file(tmp_path, tiny_model_dir, name="bad", train={"accuracy_steps": -1}))
