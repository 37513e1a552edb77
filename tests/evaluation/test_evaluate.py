"""delft eval end to end on tiny models: a base model, a LoRA run directory, JSON/plot, and user errors."""

import json
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import lora_run as _lora_run
from helpers import run_cli
from rich.console import Console
from tiny import save_digit_model as _digit_model

from delft.evaluation.command import run_eval

FAST = ["eval.max_new_tokens=4", "eval.batch_size=2", "eval.bootstrap=50"]


@pytest.fixture(scope="module")
def digit_model(digit_model_path) -> Path:
    """conftest's session-wide digit model, under this module's shorter name."""
    return digit_model_path


@pytest.fixture(scope="module")
def lora_run(digit_model, tmp_path_factory) -> Path:
    return _lora_run(digit_model, tmp_path_factory.mktemp("runs") / "lora")


def test_eval_base_and_adapter_json(digit_model, lora_run, tmp_path):
    out, png = tmp_path / "eval.json", tmp_path / "places.png"
    results = run_eval(recipe_path=None, runs=[str(lora_run)], model=str(digit_model), data="synthetic", limit=5,
                       json_out=out, plot=png, overrides=FAST, console=Console(width=160, record=True))
    assert [r.name for r in results] == ["base", "lora"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    assert report["settings"]["n"] == 5 and report["settings"]["limit"] == 5
    assert report["settings"]["data"]["synthetic"]["seed"] != 0  # disjoint from the training seed
    models = report["models"]
    assert [m["name"] for m in models] == ["base", "lora"]
    assert models[0]["adapter"] is None and models[1]["adapter"] == str(lora_run)
    assert models[0]["vs_base"] is None and models[1]["vs_base"]["exact_match"]["difference"] is not None
    golds = [p["gold"] for p in models[0]["predictions"]]
    assert [p["gold"] for p in models[1]["predictions"]] == golds
    for m in models:
        preds, met = m["predictions"], m["metrics"]
        assert len(preds) == met["n"] == 5
        assert met["exact_match"] == pytest.approx(sum(p["exact"] for p in preds) / 5)
        assert met["tolerance_match"] == pytest.approx(sum(p["tolerance"] for p in preds) / 5)
        assert met["no_number_rate"] == pytest.approx(sum(p["rule"] == "none" for p in preds) / 5)
        assert met["no_number_rate"] == 0  # the digit-only model always answers with a number
        lo, hi = met["exact_match_ci"]
        assert lo <= met["exact_match"] <= hi
        errs = [abs(Decimal(p["extracted"]) - Decimal(p["gold"])) for p in preds if p["extracted"] is not None]
        assert met["mae"] == pytest.approx(float(sum(errs) / len(errs)))
        for name, place in met["per_place"].items():
            flags = [p["places"][name] for p in preds if name in p["places"]]
            assert place["n"] == len(flags) and place["accuracy"] == pytest.approx(sum(flags) / len(flags))
        assert sum(met["rules"].values()) == 5
        for p in preds:
            assert set(p) >= {"prompt", "gold", "generated", "extracted", "rule", "exact", "tolerance", "places"}
            assert p["prompt"].startswith("<|user|>What is ") and p["prompt"].endswith("<|assistant|>")
            assert p["extracted"] is not None and p["generated"].strip()
    # the adapter changes the answers (B is non-zero): otherwise the test would not show it was applied
    assert [p["generated"] for p in models[0]["predictions"]] != [p["generated"] for p in models[1]["predictions"]]


def test_batched_generation_matches_one_by_one(digit_model):
    """Left padding + KV cache: a batch gives the same greedy answers as one prompt at a time."""
    from delft.evaluation.generation import greedy
    from delft.models.loading import load_for_inference

    model, tok = load_for_inference(str(digit_model), device="cpu")
    prompts = [f"<|user|>What is {q}?</s>\n<|assistant|>" for q in ("1 + 1", "12 * 345", "9", "-7.5 / 2.5")]

    def texts(batch_size, stops):
        return [g.text for g in greedy(model, tok, prompts, 5, True, batch_size, stops, [tok.eos_token_id])]

    batched, single = texts(4, []), texts(1, [])
    assert batched == single and all(batched)
    # a stop string ends that sequence's generation (the others in the batch go on)
    stop = batched[1][2]
    stopped = texts(4, [stop])
    assert stopped[1] == batched[1][: batched[1].index(stop) + 1]
    assert all(b.startswith(s) for b, s in zip(batched, stopped))


def test_recipe_includes_finished_run_and_limit(digit_model, lora_run, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: {digit_model}}}\noutput: {{dir: {lora_run}}}\neval: {{limit: 3}}\n")
    results = run_eval(recipe_path=recipe, include_base=False, overrides=FAST, console=Console(width=160))
    assert [r.name for r in results] == ["lora"] and results[0].metrics["n"] == 3


def test_cli_eval_set_without_answers(digit_model, tmp_path):
    data = tmp_path / "alpaca.jsonl"
    data.write_text('{"instruction": "Say hello", "output": "Hello there"}\n'
                    '{"instruction": "Name a colour", "output": "blue"}\n')
    r = run_cli("eval", "--model", digit_model, "--data", data, "--format", "alpaca",
                *sum((["--set", s] for s in FAST), []))
    assert r.exit_code == 2, r.output
    assert "no numeric answers" in r.output


def test_cli_missing_adapter(digit_model, tmp_path):
    r = run_cli("eval", "--model", digit_model, "--data", "synthetic", tmp_path / "no-such-run")
    assert r.exit_code == 2, r.output
    assert "does not exist" in r.output


def test_cli_adapter_for_another_base(digit_model, tmp_path):
    other = _digit_model(tmp_path / "other", hidden=64)
    run = _lora_run(other, tmp_path / "other-run")
    r = run_cli("eval", "--model", digit_model, "--data", "synthetic", "--limit", "2", run)
    assert r.exit_code == 2, r.output
    assert "trained on" in r.output
    bare = _lora_run(other, tmp_path / "bare-run", info=False)  # no delft_run.json: peft's own shape check
    r = run_cli("eval", "--model", digit_model, "--data", "synthetic", "--limit", "2", "--no-base", bare)
    assert r.exit_code == 2, r.output
    assert "does not fit" in r.output


def test_cli_needs_model_and_data_without_recipe(digit_model, tmp_path):
    r = run_cli("eval", "--data", "synthetic")
    assert r.exit_code == 2 and "--model" in r.output
    r = run_cli("eval", "--model", digit_model, "--data", tmp_path / "x.jsonl")
    assert r.exit_code == 2 and "--format" in r.output
    r = run_cli("eval", "--model", digit_model, "--data", "synthetic", "--no-base")
    assert r.exit_code == 2 and "nothing to evaluate" in r.output
