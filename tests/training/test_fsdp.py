"""Sharded training (train.distributed fsdp, delft.training.sharding): real torchrun processes on the CPU (gloo), FSDP2
shards of the tiny model, compared with one unsharded process on the same global batch."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import adapter_weights, recipe_file, run_cli
from test_distributed import LOGGED, finished, start, torchrun, wait_for

# Two ranks sum their gradient shards in another order than one process accumulates them, and AdamW's first steps
# divide by tiny second moments: the weights agree to float32 rounding of that, not bit for bit.
RTOL, ATOL = 1e-4, 1e-5


def model_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(run_dir.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}


def assert_same_weights(a: dict, b: dict, moved_from: dict = None) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    if moved_from is not None:  # training changed the weights, so equal means equal after real steps
        assert any(not torch.equal(a[k], moved_from[k]) for k in moved_from)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_log(a_dir: Path, b_dir: Path) -> None:
    rows, ref = metrics(a_dir), metrics(b_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for r, q in zip(rows, ref):
        assert set(r) == set(q)
        for key in LOGGED:
            if q.get(key) is not None:
                assert r[key] == pytest.approx(q[key], rel=1e-4, abs=1e-6), (key, r["step"], r[key], q[key])


def full_recipes(tmp_path: Path, model_dir: Path, **train) -> tuple[Path, Path, Path]:
    """(one process x 2 micro-batches, ddp; 2 ranks x 1, fsdp; 2 ranks x 1, ddp) of a full fine-tuning run."""
    common = {"finetuning": "full", "max_steps": 4, "save_steps": 2, "eval_steps": 2, **train}
    loss = {"type": "del_prob", "weight": 0.5}
    one = recipe_file(tmp_path, model_dir, name="one", loss=loss, train={**common, "grad_accum": 2})
    fsdp = recipe_file(tmp_path, model_dir, name="fsdp", loss=loss,
                       train={**common, "grad_accum": 1, "distributed": "fsdp"})
    ddp = recipe_file(tmp_path, model_dir, name="ddp", loss=loss, train={**common, "grad_accum": 1})
    return one, fsdp, ddp


@pytest.mark.slow
def test_fsdp_full_finetuning_on_two_ranks_equals_one_process_and_ddp(tmp_path, tiny_model_dir):
    from delft.recipe.files import load_recipe
    from delft.rundir import read_info
    from delft.training.stages import run_training

    one, fsdp, ddp = full_recipes(tmp_path, tiny_model_dir)
    out = finished(torchrun(fsdp))
    run_training(load_recipe(one))
    finished(torchrun(ddp))
    start_weights = model_weights(tiny_model_dir)
    assert_same_weights(model_weights(tmp_path / "fsdp"), model_weights(tmp_path / "one"), start_weights)
    assert_same_weights(model_weights(tmp_path / "fsdp"), model_weights(tmp_path / "ddp"))
    assert_same_log(tmp_path / "fsdp", tmp_path / "one")
    assert read_info(tmp_path / "fsdp")["world_size"] == 2 and out.count("done model") == 1
    assert "on 2 processes sharded by FSDP2, 1/2 of the weights on each" in out
    from transformers import AutoModelForCausalLM  # an ordinary directory: from_pretrained loads it

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp").num_parameters() > 0
