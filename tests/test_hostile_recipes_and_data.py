"""Hostile inputs that used to train or run with rc 0 (issue 51, item 8): a data.max_length past the model's context,
snapshot steps after the last step, data whose completions are all empty, and inspect's --adapter with --compare.
Each is refused as one paragraph, exit 2, where the user meets it (recipe check, train, inspect); real tiny models,
real data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import recipe_file, refused, run_cli

from delft.data.pipeline import build_datasets
from delft.errors import UserError
from delft.models.context import check_model_max_length, config_context
from delft.recipe.schema import validate_recipe
from delft.rundir import RUN_INFO


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- data.max_length and the context


def test_a_max_length_past_the_models_context_is_refused_at_recipe_check_and_train(tiny_model_dir, tmp_path):
    assert config_context(tiny_model_dir) == 512  # tests/tiny.py's max_position_embeddings
    rec = recipe_file(tmp_path, tiny_model_dir, data={"max_length": 1_000_000_000})
    for command in (("recipe", "check"), ("train",)):
        refused(run_cli(*command, rec), "data.max_length 1000000000 is longer than", "context of 512 tokens",
                str(tiny_model_dir / "config.json"), "Set data.max_length to 512 or less")
    assert not (tmp_path / "run").exists()  # train refused before its run directory was made
    ok = recipe_file(tmp_path, tiny_model_dir, name="fits", data={"max_length": 512})
    assert run_cli("recipe", "check", ok).exit_code == 0


def test_a_loaded_model_is_checked_against_its_context_too(tiny_model_dir):
    """A hub model not yet downloaded has no config.json to read before it loads: train checks the loaded one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    check_model_max_length(512, model, "org/model")
    with pytest.raises(UserError, match="data.max_length 513 is longer than org/model's context of 512 tokens"):
        check_model_max_length(513, model, "org/model")


# ----------------------------------------------------------------------------- snapshot steps past the end


def test_a_snapshot_step_past_max_steps_is_refused_at_recipe_check(tiny_model_dir, tmp_path):
    rec = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 6, "snapshot_steps": [3, 10**12]})
    refused(run_cli("recipe", "check", rec), f"snapshot_steps [{10**12}] come after train.max_steps 6",
            "never be taken")
    validate_recipe({"train": {"max_steps": 6, "snapshot_steps": [6]}})  # the last step's snapshot is taken


def test_a_snapshot_step_past_the_epochs_is_refused_before_the_model_loads(tiny_model_dir, tmp_path):
    # 48 synthetic examples, 8 for validation: 40 / batch 4 = 10 steps in one epoch
    rec = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": None, "epochs": 1, "snapshot_steps": [5, 11]})
    assert run_cli("recipe", "check", rec).exit_code == 0  # the total is known only from the data
    refused(run_cli("train", rec), "snapshot_steps [11] come after the run's last step",
            "train.epochs 1 over this data is 10 steps", "Give steps of at most 10")
    assert not (tmp_path / "run" / RUN_INFO).exists()


# ----------------------------------------------------------------------------- empty completions


@pytest.mark.parametrize("rows, said", [
    ([{"prompt": f"What is {i} + 1?", "completion": ""} for i in range(6)], "its completion is empty"),
    ([{"prompt": "", "completion": " "} for _ in range(6)], "its prompt and completion are empty"),
])
def test_a_file_of_empty_completions_is_refused(rows, said, tiny_model_dir, tmp_path):
    data = jsonl(tmp_path / "empty.jsonl", rows)
    rec = recipe_file(tmp_path, tiny_model_dir, data={"source": str(data), "format": "prompt_completion",
                                                      "val_size": 0})
    for command in (("recipe", "check"), ("train",)):
        refused(run_cli(*command, rec), f"every one of the 6 examples of {data} has nothing to learn", said,
                "end-of-sequence token alone")
    assert not (tmp_path / "run").exists()


def test_empty_completions_among_others_are_dropped_and_counted(tiny_tokenizer, tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1) if i % 3 else ""} for i in range(9)]
    cfg = validate_recipe({"data": {"source": str(jsonl(tmp_path / "some.jsonl", rows)),
                                    "format": "prompt_completion", "val_size": 0}}).data
    train, _, stats = build_datasets(cfg, tiny_tokenizer, 0)
    assert stats.empty == 3 and len(train) == 6 and stats.examples == 9
    learned = {tiny_tokenizer.decode([t for t in item.labels if t >= 0]) for item in train}
    assert all(any(c.isdigit() for c in text) for text in learned), learned  # no EOS-only example left
    # with train_on_prompt the prompt is learned too: nothing is empty
    cfg.train_on_prompt = True
    assert build_datasets(cfg, tiny_tokenizer, 0)[2].empty == 0


# ----------------------------------------------------------------------------- inspect --adapter with --compare


def test_inspect_refuses_adapter_with_compare_naming_both_ways(tmp_path):
    run = tmp_path / "run"
    r = run_cli("inspect", "--adapter", run, "--compare", run, "base", "What is 2 + 2?")
    refused(r, f"--adapter {run} and --compare do not go together", f"Use --adapter {run} \"prompt\"",
            f"--compare {run} {run} base \"prompt\"")
