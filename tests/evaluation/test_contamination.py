"""Contamination in delft eval: the one normalised prompt, a generated eval set drawn without the training
problems (its size kept, the same every time), each run's training problems counted in the JSON with exact match on
the unseen ones, and a set that is mostly training data refused unless --allow-seen."""

import json
from pathlib import Path

import pytest
from helpers import lora_run, run_cli, write_yaml
from rich.console import Console

from delft.data.pipeline import load_examples
from delft.data.sources import normalised_prompt
from delft.errors import UserError
from delft.evaluation.command import run_eval
from delft.recipe.files import dump_recipe
from delft.recipe.schema import DataConfig, validate_recipe
from delft.rundir import RECIPE

FAST = ["eval.max_new_tokens=4", "eval.batch_size=4", "eval.bootstrap=20"]
# A small space of problems: a 300-problem training draw holds most one-digit sums, so another seed repeats many.
SMALL = {"n": 300, "ops": ["+"], "min_digits": 1, "max_digits": 2, "decimal_fraction": 0, "negative_fraction": 0}


def quiet() -> Console:
    return Console(width=200, record=True)


def test_normalised_prompt_collapses_whitespace_and_keeps_case():
    assert normalised_prompt("  What is 12 +\t7?\r\n") == normalised_prompt("What is 12 + 7?") == "What is 12 + 7?"
    assert normalised_prompt("What is X?") != normalised_prompt("what is x?")
    assert normalised_prompt("cafe\u0301") == normalised_prompt("caf\u00e9")  # one character, two spellings
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is  12 + 7?"}]
    assert normalised_prompt(chat) == "What is 12 + 7?"


def test_a_generated_set_skips_excluded_problems_keeps_its_size_and_is_the_same_each_time():
    train = load_examples(DataConfig(synthetic=SMALL))
    seen = frozenset(normalised_prompt(e.prompt) for e in train)
    eval_cfg = DataConfig(synthetic={**SMALL, "seed": 7}, limit=40)
    by_seed_alone = load_examples(eval_cfg)
    assert sum(normalised_prompt(e.prompt) in seen for e in by_seed_alone) >= 5  # the leak a seed leaves
    drawn = load_examples(eval_cfg, exclude=seen)
    assert len(drawn) == 40 and not [e for e in drawn if normalised_prompt(e.prompt) in seen]
    assert [e.prompt for e in load_examples(eval_cfg, exclude=seen)] == [e.prompt for e in drawn]
    first = load_examples(eval_cfg.model_copy(update={"limit": 10}), exclude=seen)
    assert [e.prompt for e in first] == [e.prompt for e in drawn[:10]]  # the first N are the set of N
    one_digit = {**SMALL, "max_digits": 1}  # 100 problems, every one in a 2,000-problem draw
    all_seen = frozenset(normalised_prompt(e.prompt) for e in load_examples(DataConfig(synthetic={**one_digit,
                                                                                               "n": 2000})))
    with pytest.raises(UserError, match="gave only 0 of the 40 problems") as err:
        load_examples(DataConfig(synthetic={**one_digit, "seed": 7}, limit=40), "eval.data", exclude=all_seen)
    assert err.value.where == "eval.data.synthetic"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """train.jsonl (8 sums) and, beside it, eval files sharing 2 and 5 of their 7 prompts with it (written with
    other spacing, so only the normalisation finds them)."""
    root = tmp_path_factory.mktemp("contamination")
    sums = [(12, 7), (30, 4), (5, 5), (41, 8), (6, 2), (17, 3), (9, 9), (23, 1)]
    rows = [{"prompt": f"What is {a} + {b}?", "completion": str(a + b)} for a, b in sums]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fresh = [{"prompt": f"What is {a} + {b}?", "completion": str(a + b)} for a, b in [(50, 6), (71, 2), (8, 8),
                                                                                   (60, 3), (44, 4)]]
    for name, shared in (("some_seen.jsonl", 2), ("mostly_seen.jsonl", 5)):
        copies = [{**r, "prompt": "  " + r["prompt"].replace(" ", "  ") + "\n"} for r in rows[:shared]]
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in copies + fresh[:7 - shared]))
    return root


@pytest.fixture(scope="module")
def file_run(digit_model_path, files, tmp_path_factory) -> Path:
    """A run whose recipe.yaml says it trained on train.jsonl."""
    run = lora_run(digit_model_path, tmp_path_factory.mktemp("runs") / "lora")
    (run / RECIPE).write_text(dump_recipe(validate_recipe({
        "model": {"name": str(digit_model_path)}, "output": {"dir": str(run)},
        "data": {"source": str(files / "train.jsonl"), "format": "prompt_completion"}})))
    return run


def test_eval_json_counts_each_runs_training_problems_and_scores_the_unseen(digit_model_path, files, file_run,
                                                                          tmp_path):
    out, console = tmp_path / "eval.json", quiet()
    run_eval(runs=[str(file_run)], model=str(digit_model_path), data=str(files / "some_seen.jsonl"),
             data_format="prompt_completion", json_out=out, overrides=FAST, console=console)
    base, run = json.loads(out.read_text())["models"]
    assert base["contamination"] == {"seen_in_training": 0, "n": 7, "seen_problems": [], "near_duplicates": 0,
                                     "near_duplicate_problems": []}
    seen = run["contamination"]
    assert (seen["seen_in_training"], seen["n"], seen["seen_problems"]) == (2, 7, [0, 1])
    unseen = [p["exact"] for p in run["predictions"] if p["index"] not in (0, 1)]
    assert seen["unseen"] == {"n": 5, "exact_match": pytest.approx(sum(unseen) / 5)}
    text = " ".join(console.export_text().split())
    assert "2 of the 7 problems are in the training data of lora" in text and "on the 5 unseen" in text, text


def test_eval_refuses_a_set_that_is_mostly_training_data_unless_allowed(digit_model_path, files, file_run,
                                                                       tmp_path):
    args = ["eval", str(file_run), "--model", digit_model_path, "--data", files / "mostly_seen.jsonl",
            "--format", "prompt_completion", *[x for o in FAST for x in ("--set", o)]]
    result = run_cli(*args, "--json", tmp_path / "refused.json")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())
    assert "--data: the eval set (" in text and "is mostly training data: 5 of its 7 problems" in text, text
    assert "--allow-seen" in text and not (tmp_path / "refused.json").exists()
    allowed = run_cli(*args, "--allow-seen", "--json", tmp_path / "allowed.json")
    assert allowed.exit_code == 0, allowed.output
    report = json.loads((tmp_path / "allowed.json").read_text())
    assert report["settings"]["allow_seen"] is True
    assert report["models"][1]["contamination"]["seen_in_training"] == 5
    assert report["models"][1]["contamination"]["unseen"]["n"] == 2


def test_eval_draws_a_generated_set_without_the_recipes_and_runs_training_problems(digit_model_path, tmp_path):
    """The recipe's own eval set (its training source, another seed): a seed alone repeats training problems
    here; the drawn set holds none of them, for the run as counted from its recipe.yaml."""
    data = {"synthetic": SMALL, "val_size": 0}
    recipe = write_yaml(tmp_path / "r.yaml", {"model": {"name": str(digit_model_path)}, "data": data,
                                              "eval": {"limit": 30}, "output": {"dir": str(tmp_path / "none")}})
    run = lora_run(digit_model_path, tmp_path / "lora")
    (run / RECIPE).write_text(dump_recipe(validate_recipe({"model": {"name": str(digit_model_path)},
                                                           "data": data, "output": {"dir": str(run)}})))
    out = tmp_path / "eval.json"
    run_eval(recipe_path=recipe, runs=[str(run)], json_out=out, overrides=FAST, console=quiet())
    report = json.loads(out.read_text())
    training = {normalised_prompt(e.prompt) for e in load_examples(DataConfig(**data))}
    by_seed_alone = load_examples(DataConfig.model_validate({**report["settings"]["data"], "limit": 30}))
    assert sum(normalised_prompt(e.prompt) in training for e in by_seed_alone) > 0
    asked = [p["prompt"].removeprefix("<|user|>").split("</s>")[0] for p in report["models"][0]["predictions"]]
    assert len(asked) == 30 and not [q for q in asked if normalised_prompt(q) in training], asked
    assert report["models"][1]["contamination"]["seen_in_training"] == 0


def test_a_snapshot_is_read_back_in_its_runs_number_form(tmp_path):
    """A snapshot keeps only the model; how it writes numbers is its run's recipe.yaml's data.numbers (a study's
    curve evaluates snapshots of reversed runs: read naturally, every reversed answer would score wrong)."""
    from delft.recipe.files import dump_recipe, trained_numbers, trained_recipe
    from delft.recipe.schema import validate_recipe
    from delft.rundir import RECIPE, snapshot_path

    run = tmp_path / "run"
    snap = snapshot_path(run, 250)
    snap.mkdir(parents=True)
    (run / RECIPE).write_text(dump_recipe(validate_recipe({"data": {"numbers": {"order": "reversed"}}})))
    assert trained_recipe(snap) == run / RECIPE and trained_recipe(run) == run / RECIPE
    assert trained_numbers(snap).order == "reversed"
    assert trained_recipe(tmp_path / "elsewhere" / "snapshots" / "step-000250") is None
    assert trained_numbers(tmp_path / "merged") is None  # nothing says: the eval's own form is used
