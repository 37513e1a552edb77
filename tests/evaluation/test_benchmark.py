"""`delft eval --data nupa`: the digit-level benchmark as a data source (drawn without the training problems) and
its report per task and length bin, recomputed by brute force from the JSON's own predictions."""

import json

import pytest
from helpers import run_cli, write_yaml
from rich.console import Console

from delft.data import number_tasks
from delft.data.pipeline import load_examples
from delft.data.sources import normalised_prompt
from delft.evaluation.command import run_eval
from delft.evaluation.contamination import generated_exclusion
from delft.errors import UserError
from delft.recipe.schema import EVAL_SEED_OFFSET, DataConfig, NupaConfig, Recipe

NUPA = {"tasks": ["integer/add", "integer/max", "decimal/round"], "min_length": 1, "max_length": 3, "per_bin": 3}


def test_the_benchmark_source_is_the_generator_binned_and_the_eval_draw_skips_training(tmp_path):
    cfg = Recipe.model_validate({"data": {"source": "nupa", "format": "nupa", "nupa": NUPA}})
    train = load_examples(cfg.data)
    want = number_tasks.draw(3, 0, NUPA["tasks"], range(1, 4))
    assert [(e.prompt, e.answer, e.item) for e in train] == [(p.prompt, p.answer, {"task": p.task, "length": p.length})
                                                              for p in want]
    assert {e.item["task"] for e in train} == set(NUPA["tasks"])
    assert {e.item["length"] for e in train if e.item["task"] == "decimal/round"} == {2, 3}  # decimals need 2 digits
    exclude = generated_exclusion(cfg.eval_data(), [cfg.data], [])
    held_out = load_examples(cfg.eval_data(), "eval.data", exclude)
    assert len(held_out) == len(train) and not exclude & {normalised_prompt(e.prompt) for e in held_out}


def test_eval_on_the_benchmark_reports_every_bin(tmp_path, digit_model_path):
    recipe = write_yaml(tmp_path / "r.yaml", {"model": {"name": str(digit_model_path)},
                                              "data": {"source": "nupa", "format": "nupa", "nupa": NUPA},
                                              "eval": {"max_new_tokens": 4, "batch_size": 8, "bootstrap": 50}})
    out, plot = tmp_path / "eval.json", tmp_path / "eval.png"
    console = Console(record=True, width=200)
    run_eval(recipe_path=recipe, json_out=out, plot=plot, console=console)
    report = json.loads(out.read_text())
    bins, predictions = report["number_tasks"]["base"], report["models"][0]["predictions"]
    cfg = Recipe.model_validate({"data": {"source": "nupa", "format": "nupa", "nupa": NUPA}})
    examples = load_examples(cfg.eval_data(), "eval.data", generated_exclusion(cfg.eval_data(), [cfg.data], []))
    assert len(predictions) == len(examples) == sum(b["n"] for by in bins.values() for b in by.values())
    for task, by_length in bins.items():
        for length, b in by_length.items():
            rows = [(p, e) for p, e in zip(predictions, examples)
                    if e.item == {"task": task, "length": int(length)}]
            assert b["n"] == len(rows) == 3
            exact = [number_tasks.exact_match(p["extracted"], e.answer) for p, e in rows]
            digits = [number_tasks.digit_match(p["extracted"], e.answer) for p, e in rows]
            assert b["exact_match"] == sum(exact) / 3 and b["digit_match"] == sum(digits) / 3
            assert [p["exact"] for p, _ in rows] == exact  # the eval's own scorer agrees per problem
    assert set(bins) == set(NUPA["tasks"]) and set(bins["decimal/round"]) == {"2", "3"}
    text = console.export_text()
    assert "exact match (%) per" in text and "integer/max" in text  # the table (its title wraps)
    assert (tmp_path / "eval-number-tasks.png").stat().st_size > 0


@pytest.mark.slow
def test_eval_on_the_benchmark_with_its_defaults_scores_a_model(tmp_path, digit_model_path):
    out = tmp_path / "eval.json"
    result = run_cli("eval", "--model", digit_model_path, "--data", "nupa", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    default = NupaConfig()
    assert report["settings"]["data"]["nupa"] == {**default.model_dump(), "seed": default.seed + EVAL_SEED_OFFSET}
    scored = report["models"][0]["predictions"]
    assert len(scored) == report["settings"]["n"] == Recipe().eval.limit  # the first 200 of 1,170 problems
    bins = report["number_tasks"]["base"]
    assert sum(b["n"] for by in bins.values() for b in by.values()) == len(scored)


def _recipe_check(tmp_path, nupa: dict, eval_nupa: dict | None = None):
    recipe = {"data": {"source": "nupa", "format": "nupa", "nupa": nupa}}
    if eval_nupa is not None:
        recipe["eval"] = {"data": {"source": "nupa", "format": "nupa", "nupa": eval_nupa}}
    return run_cli("recipe", "check", write_yaml(tmp_path / "r.yaml", recipe))


def test_recipe_check_finds_the_bins_train_and_eval_would_refuse(tmp_path):
    assert _recipe_check(tmp_path, {}).exit_code == 0  # the defaults draw, for training and the eval set
    cfg = Recipe.model_validate({"data": {"source": "nupa", "format": "nupa"}})
    train = load_examples(cfg.data)
    held_out = load_examples(cfg.eval_data(), "eval.data", generated_exclusion(cfg.eval_data(), [cfg.data], []))
    assert len(train) == len(held_out) == 1170

    one_digit = _recipe_check(tmp_path, {"min_length": 1})
    assert one_digit.exit_code == 2 and "integer/round at length 1 (9 distinct problems)" in one_digit.output

    # 45 training problems of the 81 in two-digit integer/round leave 36 for an eval set of 45: train draws, the
    # eval draw (held-out accuracy, `delft eval RECIPE`) is refused, and recipe check finds it from the sizes
    both = _recipe_check(tmp_path, {"per_bin": 45})
    assert both.exit_code == 2 and "integer/round at length 2 (81 distinct problems, 45 of them excluded)" in " ".join(
        both.output.split())
    data = DataConfig.model_validate({"source": "nupa", "format": "nupa", "nupa": {"per_bin": 45}})
    eval_data = data.model_copy(update={"nupa": data.nupa.model_copy(update={"seed": EVAL_SEED_OFFSET})})
    assert len(load_examples(data)) == 45 * 117
    with pytest.raises(UserError, match=r"integer/round at length 2 \(81 distinct problems, 45 of them excluded\)"):
        load_examples(eval_data, "eval.data", generated_exclusion(eval_data, [data], []))
    assert _recipe_check(tmp_path, {"per_bin": 45}, {"per_bin": 30, "min_length": 3}).exit_code == 0

    huge = _recipe_check(tmp_path, {"per_bin": 10 ** 12})
    assert huge.exit_code == 2 and "less than or equal to 10000" in huge.output
