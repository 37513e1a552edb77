"""compare and study evaluate in one process and train sharded arms through delft train --nproc N: an arm with
train.distributed fsdp and no --nproc, and a compare or study run under a launcher (where every rank would train,
evaluate and write the same results folder), are refused before anything is trained, saying what works; with
--nproc 2 a compare of two fsdp arms trains each on 2 ranks and evaluates them once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import run_cli, write_arms, write_yaml


@pytest.fixture
def arms(tmp_path, tiny_model_dir):
    return write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs")


def _study(rec) -> str:
    return str(write_yaml(rec / "s.study.yaml", {"recipes": ["ce.yaml", "del.yaml"], "seeds": [0],
                                                 "out": str(rec.parent / "out"), "evals": {"synthetic": {"limit": 4}}}))


def _refused(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ["compare", "study"])
def test_fsdp_arms_without_nproc_are_refused_with_what_works(tmp_path, tiny_model_dir, command):
    arms = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs", train={"distributed": "fsdp"})
    args = ["compare", arms / "ce.yaml", arms / "del.yaml", "--out", tmp_path / "out"] if command == "compare" \
        else ["study", _study(arms)]
    said = _refused(run_cli(*args))
    assert "ce.yaml, del.yaml shard the model with train.distributed fsdp" in said
    assert "was given no --nproc" in said and f"Pass --nproc N: delft {command} then trains each arm" in said
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # nothing trained or written


@pytest.mark.parametrize("command", ["compare", "study"])
def test_compare_and_study_under_a_launcher_are_refused(tmp_path, arms, command):
    args = ["compare", arms / "ce.yaml", arms / "del.yaml", "--out", tmp_path / "out"] if command == "compare" \
        else ["study", _study(arms)]
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}  # what torchrun sets in each rank
    said = _refused(run_cli(*args, env=env))
    assert f"delft {command} runs as one process, and this one was started by a launcher" in said
    assert f"Run delft {command} without torchrun" in said
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_compare_with_nproc_trains_each_fsdp_arm_on_two_ranks_and_evaluates_once(tmp_path, tiny_model_dir):
    arms = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs", train={"distributed": "fsdp"},
                      eval={"limit": 4})
    cmd = [sys.executable, "-m", "delft", "compare", str(arms / "ce.yaml"), str(arms / "del.yaml"), "--out",
           str(tmp_path / "out"), "--nproc", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DELFT_DIST_TIMEOUT": "120"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for name in ("ce", "del"):
        info = json.loads((tmp_path / "runs" / f"{name}-seed0" / "delft_run.json").read_text())
        assert info["status"] == "completed" and info["world_size"] == 2
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert "--nproc 2" in report["command"], report.get("command")
    assert done.stdout.count("compare.json") <= 2  # one results folder, written once
