"""Where the weights live (delft.training.placement): chosen once from train.distributed, and what each placement
costs the ranks. keep_best under fsdp copies best/ as the final model without gathering the last step's weights
on any rank (every rank used to gather them, only for rank 0 to throw them away)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, recipe_file

from delft.recipe.files import load_recipe
from delft.training import placement

# Run inside each torchrun worker: count the full-state gathers (sharding.full_state_dict, a collective every rank
# enters) and the writes of best/, then print them with the rank.
WORKER = """
import json, os, sys
from delft.recipe.files import load_recipe
from delft.training import sharding, sft
from delft.training.stages import run_training

counts = {"gathers": 0, "best_saves": 0}
gather, save_best = sharding.full_state_dict, sft.Trainer.save_best

def counted_gather(root):
    counts["gathers"] += 1
    return gather(root)

def counted_save_best(self):
    counts["best_saves"] += 1
    return save_best(self)

sharding.full_state_dict = counted_gather
sft.Trainer.save_best = counted_save_best
run_training(load_recipe(sys.argv[1]))
print("COUNTS " + json.dumps({"rank": int(os.environ["RANK"]), **counts}), flush=True)
"""


def test_the_recipe_chooses_the_placement(tmp_path, tiny_model_dir):
    ddp = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="ddp"))
    fsdp = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="fsdp", train={"distributed": "fsdp"}))
    assert placement.chosen(ddp) is placement.WholeWeights and not placement.WholeWeights.sharded
    assert placement.chosen(fsdp) is placement.Sharded and placement.Sharded.sharded


@pytest.mark.slow
def test_keep_best_under_fsdp_copies_best_without_gathering_the_last_step(tmp_path, tiny_model_dir):
    """The held-out exact match of a tiny random model does not rise after its first measurement, so best/ is an
    earlier step's and the final model is copied from it: the only gathers are best/'s own writes, on both ranks."""
    from delft.rundir import read_info

    recipe = recipe_file(tmp_path, tiny_model_dir, name="fsdp", lora={"dropout": 0.0},
                         train={"distributed": "fsdp", "max_steps": 4, "save_steps": 10, "eval_steps": 10,
                                "accuracy_steps": 2, "accuracy_examples": 4, "keep_best": True,
                                "early_stopping": {"metric": "heldout_accuracy", "patience": 10}})
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DELFT_DIST_TIMEOUT": "120"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script),
                           str(recipe)], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    counts = sorted((json.loads(line.split("COUNTS ", 1)[1]) for line in out.splitlines() if "COUNTS " in line),
                    key=lambda c: c["rank"])
    assert [c["rank"] for c in counts] == [0, 1]
    best = read_info(tmp_path / "fsdp")["best"]
    assert best["written"] is True  # the final adapter is best/'s
    for c in counts:  # every rank took part in each write of best/, and in nothing more
        assert c["best_saves"] >= 1 and c["gathers"] == c["best_saves"], c
    assert (Path(tmp_path / "fsdp") / "adapter_model.safetensors").is_file()
