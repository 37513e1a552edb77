"""What a command imports, measured on the command itself: ``delft recipe check`` and a ``delft train`` whose recipe
is refused load no torch, transformers or datasets (tests/test_layout.py checks modules; a chain of imports that
only a command walks, precheck -> setup -> the loss, passed it unseen)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

HEAVY = ("torch", "transformers", "datasets")
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")


def imported(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """(the finished ``python -X importtime ARGS``, the top-level packages it imported)."""
    r = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in r.stderr.splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    return r, names


def test_the_measure_sees_an_import():
    """The parser finds what a command does import, so an empty answer below means something."""
    r, names = imported("-m", "delft", "--help")
    assert r.returncode == 0 and {"delft", "typer"} <= names
    assert "torch" in imported("-c", "import torch")[1]


@pytest.mark.parametrize("args,code,said", [
    (("recipe", "check", QUICKSTART), 0, "valid"),
    (("recipe", "check", str(REPO / "recipes" / "study" / "lora_powered.study.yaml")), 0, "valid study file"),
    (("train", "missing.yaml"), 2, "recipe file missing.yaml does not exist"),
    (("train", QUICKSTART, "--set", "train.distributed=fsdp", "--set", "lora.init=pissa", "--set",
      "quantization.mode=none"), 2, "lora.init pissa changes the base weights"),
])
def test_a_recipe_check_and_a_refused_train_load_no_torch(args, code, said):
    r, names = imported("-m", "delft", *args)
    assert r.returncode == code, r.stdout + r.stderr[-2000:]
    output = " ".join((r.stdout + r.stderr).split())
    assert said in output
    assert not names & set(HEAVY), f"delft {' '.join(args)} imported {sorted(names & set(HEAVY))}"
