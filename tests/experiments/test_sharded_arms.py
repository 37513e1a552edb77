"""compare and study train their arms in one process: an arm with train.distributed fsdp (which needs several
processes) and a run under a launcher (where every rank would train, evaluate and write the same results folder)
are refused before anything is trained, saying what works (each arm with delft train --nproc N, then delft eval)."""

from __future__ import annotations

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
def test_an_fsdp_arm_is_refused_with_what_works(tmp_path, arms, command):
    write_yaml(arms / "del.yaml", {"base": "base.yaml", "loss": {"type": "del"}, "train": {"distributed": "fsdp"},
                                   "output": {"dir": str(tmp_path / "runs" / "del-seed0")}})
    args = ["compare", arms / "ce.yaml", arms / "del.yaml", "--out", tmp_path / "out"] if command == "compare" \
        else ["study", _study(arms)]
    said = _refused(run_cli(*args))
    assert "del.yaml shards the model with train.distributed fsdp" in said
    assert "delft train ARM.yaml --nproc N" in said and "delft eval" in said
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
