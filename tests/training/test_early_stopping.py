"""train.early_stopping and train.keep_best: the tracker's rule on hand-made sequences; a real run that stops at
the right step and writes the best step's adapter; a resumed run that stops where the uninterrupted one did."""

import json

import pytest
import torch
from helpers import adapter_weights, interrupt_on_step, recipe_file, write_yaml

import delft.training.sft as train_mod
from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.rundir import read_info, snapshot_path
from delft.training.early_stopping import EarlyStopping
from delft.training.stages import run_training

# validation losses at steps 1, 2, 3, ...: the best is step 5 (0.49, the lowest); it is not lower than step 3's 0.5
# by more than min_delta 0.05, so patience keeps counting from step 3 and the run stops at step 6
SCRIPT = [1.0, 0.8, 0.5, 0.6, 0.49, 0.7, 0.4, 0.3]


def test_the_tracker_stops_after_patience_measurements_without_an_improvement():
    t = EarlyStopping("val_loss", min_delta=0.05, patience=3)
    for step, v in enumerate(SCRIPT, 1):
        t.update(v, step)
        if t.should_stop:
            break
    assert (step, t.best_step, t.best) == (6, 5, 0.49)  # measurement 6: the third without an improvement by 0.05
    acc = EarlyStopping("heldout_accuracy", patience=2)
    for step, v in enumerate([0.1, 0.3, 0.3, 0.2], 1):
        acc.update(v, step)
    assert acc.best_step == 2 and acc.should_stop  # higher is better; equal is no improvement


def scripted(monkeypatch, values=SCRIPT):
    """evaluate_loss returns ``values`` in turn (the real training steps and validation run as usual)."""
    from delft.training.step import evaluate_loss

    left = iter(values)

    def fake(*a, **k):
        out = evaluate_loss(*a, **k)
        out["val_loss"] = next(left)
        return out

    monkeypatch.setattr(train_mod, "evaluate_loss", fake)


TRACKED = {"max_steps": 8, "eval_steps": 1, "save_steps": 2, "snapshot_steps": [5], "keep_best": True,
           "early_stopping": {"metric": "val_loss", "patience": 3, "min_delta": 0.05}}


def test_a_run_stops_at_the_right_step_and_writes_the_best_steps_adapter(tmp_path, tiny_model_dir, monkeypatch):
    scripted(monkeypatch)
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train=TRACKED)))
    info = read_info(run)
    assert info["status"] == "completed" and info["step"] == 6 and info["stopped_early"]["step"] == 6
    assert info["best"]["step"] == 5 and info["best"]["value"] == 0.49 and info["best"]["written"]
    assert "lowest val_loss of 6 measurements" in info["best"]["why"]
    best, final = adapter_weights(snapshot_path(run, 5)), adapter_weights(run)
    for k in best:  # the adapter at the top is step 5's, not step 6's
        assert torch.equal(best[k], final[k]), k
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 6 and not (run / "best").exists()


def test_a_resumed_run_stops_where_the_uninterrupted_one_did(tmp_path, tiny_model_dir, monkeypatch):
    scripted(monkeypatch)
    straight = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight", train=TRACKED)))
    path = recipe_file(tmp_path, tiny_model_dir, name="resumed", train=TRACKED)
    scripted(monkeypatch)
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    restore()
    scripted(monkeypatch, SCRIPT[4:])  # the resumed run validates from step 5 on (its checkpoint is step 4)
    run_training(load_recipe(path))
    a, b = read_info(straight), read_info(tmp_path / "resumed")
    assert (a["step"], a["best"]["step"]) == (b["step"], b["best"]["step"]) == (6, 5)
    wa, wb = adapter_weights(straight), adapter_weights(tmp_path / "resumed")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("data,train,message", [
    ({"val_size": 0}, {"keep_best": True}, "need a validation split"),
    ({}, {"early_stopping": {"metric": "heldout_accuracy"}}, "measured every train.accuracy_steps"),
    ({}, {"stage": "grpo", "keep_best": True}, "apply to train.stage sft"),
])
def test_early_stopping_refuses_what_it_cannot_measure(tmp_path, data, train, message):
    with pytest.raises(UserError, match=message):
        load_recipe(write_yaml(tmp_path / "r.yaml", {"data": data, "train": train}))
