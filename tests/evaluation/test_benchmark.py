"""`delft eval --data nupa`: the digit-level benchmark as a data source (drawn without the training problems) and
its report per task and length bin, recomputed by brute force from the JSON's own predictions."""

import json

from helpers import write_yaml
from rich.console import Console

from delft.data import number_tasks
from delft.data.pipeline import load_examples
from delft.data.sources import normalised_prompt
from delft.evaluation.command import run_eval
from delft.evaluation.contamination import generated_exclusion
from delft.recipe.schema import Recipe

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
