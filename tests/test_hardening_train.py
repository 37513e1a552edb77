"""Bad input to `delft train` (recipes, data, run directories, interrupts, kills): a clear refusal or an exact
recovery, never a traceback and never a lost or mixed-up run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import delft.train as train_mod
from delft.errors import UserError
from delft.recipe import load_recipe
from delft.rundir import CHECKPOINTS, METRICS, RUN_INFO, checkpoints, latest_checkpoint, read_info
from delft.train import run_training
from helpers import adapter_weights, recipe_file


def write(tmp_path: Path, text, name="r.yaml") -> Path:
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


# ----------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("text, message", [
    ("train:\n  learning_rate: yes\n", "learning_rate got the YAML boolean True"),
    ("train:\n  max_steps: no\n", "max_steps got the YAML boolean False"),
    ("train:\n  learning_rate: .inf\n", "learning_rate: Input should be a finite number"),
    ("loss:\n  weight: .nan\n", "loss.weight: Input should be a finite number"),
    ("", "empty recipe"),
    ("# only a comment\n", "empty recipe"),
    ("train:\n  seed: 1\n  batch_size: 2\n  seed: 2\n", "key 'seed' appears twice \\(lines 2 and 4\\)"),
    (b"train:\n  seed: 1\n\xff\xfe\x00\x01", "not a text \\(UTF-8\\) file: byte 0xff at line 3"),
    (b"train: {}\n\x00\x00", "binary file"),
])
def test_bad_recipes_are_refused(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        load_recipe(write(tmp_path, text))


def test_fused_loss_on_off_and_home_dir(tmp_path):
    on = load_recipe(write(tmp_path, "train:\n  fused_loss: on\noutput:\n  dir: ~/runs/x\n"))
    assert on.train.fused_loss == "on" and on.output.dir == str(Path.home() / "runs" / "x")
    assert load_recipe(write(tmp_path, "train:\n  fused_loss: off\n")).train.fused_loss == "off"
    assert load_recipe(write(tmp_path, "train:\n  gradient_checkpointing: off\n")).train.gradient_checkpointing is False
    with pytest.raises(UserError, match="learning_rate got the YAML boolean"):
        load_recipe(write(tmp_path, "train: {}\n"), ["train.learning_rate=yes"])


def test_recipe_that_is_a_directory(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        load_recipe(tmp_path)
