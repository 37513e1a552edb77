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


# ----------------------------------------------------------------------------- data


def data_cfg(source, fmt="prompt_completion", **kw):
    from delft.recipe import DataConfig

    return DataConfig(source=str(source), format=fmt, **kw)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_data_file_with_a_non_utf8_byte_names_file_and_line(tmp_path, suffix):
    from delft.data import load_examples

    good = {".jsonl": b'{"prompt": "a", "completion": "1"}\n',
            ".json": b'[{"prompt": "a", "completion": "1"},\n', ".csv": b"prompt,completion\n"}[suffix]
    path = tmp_path / f"d{suffix}"
    path.write_bytes(good + b'{"prompt": "caf\xe9", "completion": "2"}\n')
    with pytest.raises(UserError, match=f"d{suffix} line 2 is not UTF-8 text \\(byte 0xe9\\)"):
        load_examples(data_cfg(path))


def test_a_count_val_size_may_not_take_most_of_the_data(tmp_path, tiny_tokenizer):
    from delft.data import build_datasets

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1", "completion": str(i + 1)}) + "\n" for i in range(40)))
    with pytest.raises(UserError, match="val_size 32 would take 32 of the 40 usable examples"):
        build_datasets(data_cfg(path, val_size=32), tiny_tokenizer, 0)
    train, val, _ = build_datasets(data_cfg(path, val_size=20), tiny_tokenizer, 0)
    assert (len(train), len(val)) == (20, 20)
    train, val, _ = build_datasets(data_cfg(path, val_size=0.9), tiny_tokenizer, 0)  # a fraction is taken as meant
    assert (len(train), len(val)) == (4, 36)


def test_a_huge_line_is_cut_before_tokenizing_and_counted(tmp_path, tiny_tokenizer):
    from delft.data import CHARS_PER_TOKEN_BUDGET, build_datasets, tokenize_example, Example

    cfg = data_cfg(tmp_path / "unused.jsonl", max_length=16)
    budget = 16 * CHARS_PER_TOKEN_BUDGET
    calls = []
    real_encode = tiny_tokenizer.encode

    class Watching:  # the real tokenizer, recording how long a text it was asked to encode
        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def encode(self, text, **kw):
            calls.append(len(text))
            return real_encode(text, **kw)

    tok = tokenize_example(Example("1 + " * 200_000, "2"), Watching(), cfg)
    assert tok.truncated and len(tok.input_ids) == 16
    assert max(calls) <= budget
    short = tokenize_example(Example("1 + 1", "2"), tiny_tokenizer, cfg)
    assert not short.truncated
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "9" * 100_000, "completion": "1"}) + "\n"
                    + json.dumps({"prompt": "1 + 1", "completion": "2"}) + "\n")
    _, _, stats = build_datasets(data_cfg(path, max_length=16, val_size=0, train_on_prompt=True), tiny_tokenizer, 0)
    assert stats.truncated == 1
