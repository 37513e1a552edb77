"""data.source reasoning_gym: problems from reasoning-gym's offline generators, for eval (scored by delft and by
the task's own score_answer) and for training."""

from __future__ import annotations

import json

import pytest
from helpers import recipe_file
from rich.console import Console

from delft.data.pipeline import load_examples
from delft.errors import UserError
from delft.evaluation.command import run_eval
from delft.recipe.schema import DataConfig
from delft.recipe.files import load_recipe

FAST = ["eval.max_new_tokens=6", "eval.batch_size=4", "eval.bootstrap=50"]


def rg(task="basic_arithmetic", **fields):
    return DataConfig.model_validate({"source": "reasoning_gym", "format": "reasoning_gym",
                                      "reasoning_gym": {"task": task, "n": 5, **fields}})


def test_generated_problems_are_seeded_examples_with_answers():
    first = load_examples(rg(seed=3, options={"min_digits": 2, "max_digits": 2}))
    again = load_examples(rg(seed=3, options={"min_digits": 2, "max_digits": 2}))
    other = load_examples(rg(seed=4, options={"min_digits": 2, "max_digits": 2}))
    assert [e.prompt for e in first] == [e.prompt for e in again] != [e.prompt for e in other]
    assert len(first) == 5 and all(e.completion == e.answer and e.item["answer"] == e.answer for e in first)
    cot = load_examples(rg("gsm_symbolic", completion="cot"))
    assert all(e.completion.rstrip().endswith(f"#### {e.answer}") for e in cot)


@pytest.mark.parametrize("fields,where,says", [
    ({"task": "basic_arithmatic"}, "reasoning_gym.task", "Did you mean basic_arithmetic"),
    ({"options": {"max_digit": 3}}, "reasoning_gym.options", "no option(s) max_digit"),
    ({"options": {"min_digits": 4, "max_digits": 2}}, "reasoning_gym.options", "refused the options"),
    ({"completion": "cot"}, "reasoning_gym.completion", "no worked solutions"),
])
def test_mistakes_name_the_key(fields, where, says):
    task = fields.pop("task", "basic_arithmetic")
    with pytest.raises(UserError) as e:
        load_examples(rg(task, **fields))
    assert where in e.value.where and says in str(e.value)


def test_source_and_format_go_together():
    with pytest.raises(ValueError, match="source 'reasoning_gym' goes with format 'reasoning_gym'"):
        DataConfig.model_validate({"source": "reasoning_gym", "format": "gsm8k"})


def test_eval_scores_with_delft_and_the_task_and_keeps_off_the_training_seed(digit_model_path, tmp_path):
    out = tmp_path / "rg.json"
    console = Console(width=200, record=True)
    run_eval(model=str(digit_model_path), data="reasoning_gym", limit=4, json_out=out, console=console,
             overrides=[*FAST, "data.reasoning_gym.task=products", "data.reasoning_gym.n=4"])
    report = json.loads(out.read_text())
    assert report["settings"]["data"]["reasoning_gym"]["seed"] != 0  # moved off the training seed 0
    preds = report["models"][0]["predictions"]
    assert len(preds) == 4 and all("multiplication" in p["prompt"] for p in preds)
    assert all(0.0 <= p["task_score"] <= 1.0 for p in preds)
    assert all(p["task_score"] == 1.0 for p in preds if p["exact"])  # the task agrees where delft finds it right
    metrics = report["models"][0]["metrics"]
    assert metrics["task_score"] == pytest.approx(sum(p["task_score"] for p in preds) / 4)
    assert "task's own score (reasoning-gym)" in console.export_text()


def test_training_on_generated_problems(tmp_path, tiny_model_dir):
    from delft.training.stages import run_training

    path = recipe_file(tmp_path, tiny_model_dir, data={"source": "reasoning_gym", "format": "reasoning_gym",
                                                       "reasoning_gym": {"task": "chain_sum", "n": 40}, "max_length": 128},
                       train={"max_steps": 3, "save_steps": 3})
    run = run_training(load_recipe(path))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 3
    assert (run / "adapter_model.safetensors").is_file()
