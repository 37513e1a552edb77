"""delft eval --samples (majority vote, pass@k, seeded sampling) and --fewshot (the harness's GSM8K prompt and its
two scores), on the tiny digit model."""

from __future__ import annotations

import json
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import REPO, run_cli
from rich.console import Console

from delft.evaluation.command import run_eval
from delft.evaluation.sampling import majority_index, pass_at_k, per_problem
from delft.numbers.answers import Extraction, score

FAST = ["eval.max_new_tokens=4", "eval.batch_size=2", "eval.bootstrap=50"]
GSM8K = REPO / "tests" / "data" / "gsm8k_test.jsonl"


def scored(*values, gold="5"):
    """Hand-made predictions: a number's text, or None for an answer without one."""
    return [score(Extraction(None if v is None else Decimal(v), v, "last_number" if v else "none"), Decimal(gold))
            for v in values]


def test_majority_vote_on_hand_made_predictions():
    assert majority_index(scored("3", "5", "5")) == 1
    assert majority_index(scored("3", "5", "5.0", "3")) == 0  # a tie: the value given first; 5 and 5.0 are one
    assert majority_index(scored(None, None, "8", "7", "8")) == 2  # no number does not vote
    assert majority_index(scored(None, None)) == 0  # nothing to vote on: no number
    values = per_problem([scored("3", "5", "5"), scored("4", "4", "5"), scored(None, None, None)])
    assert values["majority"] == [1.0, 0.0, 0.0]
    assert values["pass@1"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert values["pass@k"] == [1.0, 1.0, 0.0]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong: always one right
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def sampled_eval(model, tmp_path: Path, name: str, seed: int = 0, extra=()):
    out = tmp_path / f"{name}.json"
    run_eval(model=str(model), data="synthetic", limit=6, json_out=out, console=Console(width=200),
             overrides=[*FAST, "eval.samples=4", "eval.temperature=1.5", f"eval.seed={seed}", *extra])
    return json.loads(out.read_text())["models"][0]


def test_samples_report_majority_and_pass_at_k_reproducibly(digit_model_path, tmp_path):
    import torch

    first = sampled_eval(digit_model_path, tmp_path, "a")
    torch.manual_seed(1234)  # whatever ran before: the eval seed alone decides the samples
    again = sampled_eval(digit_model_path, tmp_path, "b")
    other = sampled_eval(digit_model_path, tmp_path, "c", seed=1)
    texts = [[s["generated"] for s in p["samples"]] for p in first["predictions"]]
    assert texts == [[s["generated"] for s in p["samples"]] for p in again["predictions"]]
    assert texts != [[s["generated"] for s in p["samples"]] for p in other["predictions"]]
    assert any(len(set(t)) > 1 for t in texts)  # sampled, not greedy four times
    m = first["metrics"]
    flags = [s["exact"] for p in first["predictions"] for s in p["samples"]]
    assert m["sampling"]["k"] == 4 and len(flags) == 24
    assert m["sampling"]["pass@1"] == pytest.approx(sum(flags) / 24)  # pass@1 = the mean sample accuracy
    assert m["sampling"]["pass@k"] == pytest.approx(
        sum(any(s["exact"] for s in p["samples"]) for p in first["predictions"]) / 6)
    for p in first["predictions"]:  # the reported answer is the majority vote's
        values = [s["extracted"] for s in p["samples"] if s["extracted"] is not None]
        if values:
            top = max(values.count(v) for v in values)
            assert values.count(p["extracted"]) == top
    assert m["exact_match"] == pytest.approx(sum(p["exact"] for p in first["predictions"]) / 6)


def test_sampling_with_a_batch_of_one_still_answers_every_sample(digit_model_path, tmp_path):
    m = sampled_eval(digit_model_path, tmp_path, "one", extra=["eval.batch_size=1"])
    assert all(len(p["samples"]) == 4 and all(s["generated"] for s in p["samples"]) for p in m["predictions"])


def test_fewshot_renders_the_harness_prompt_and_scores_both_ways(digit_model_path, tmp_path):
    # two character-level exemplars pass the tiny model's 512 positions, which eval now refuses before generating;
    # its rotary positions take a longer context with the same weights
    model = Path(shutil.copytree(digit_model_path, tmp_path / "long"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    out = tmp_path / "gsm.json"
    console = Console(width=200, record=True)
    run_eval(model=str(model), data=str(GSM8K), data_format="gsm8k", limit=3, json_out=out,
             console=console, overrides=[*FAST, "eval.fewshot=2"])
    report = json.loads(out.read_text())
    assert report["settings"]["fewshot"] == 2 and report["settings"]["decoding"] == "greedy"
    for p in report["models"][0]["predictions"]:
        assert p["prompt"].startswith("Question: Natalia sold clips") and p["prompt"].endswith("\nAnswer:")
        assert p["prompt"].count("Question: ") == 3 and "#### 72\n\nQuestion: Weng" in p["prompt"]
        assert isinstance(p["strict_match"], bool) and isinstance(p["flexible_extract"], bool)
    metrics = report["models"][0]["metrics"]
    assert metrics["strict_match"] is not None and metrics["flexible_extract"] is not None
    assert "strict-match (harness" in console.export_text()


def test_cli_decoding_options_and_their_refusals(digit_model_path, tmp_path):
    out = tmp_path / "cli.json"
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", "--limit", 2, "--samples", 2,
                "--temperature", 0.9, "--top-p", 0.8, "--json", out, *[x for o in FAST for x in ("--set", o)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["settings"]["decoding"] == {"samples": 2, "temperature": 0.9, "top_p": 0.8,
                                                                  "seed": 0}
    assert "pass@2" in r.output and "majority of 2 exact match" in r.output
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", "--top-p", 1.5)
    assert r.exit_code == 2 and "top_p" in r.output and "Traceback" not in r.output
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", "--fewshot", 9)
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_llama_cpp_sampling_keeps_the_nucleus_and_is_seeded():
    import numpy as np

    from delft.evaluation.gguf_backend import _pick

    logits = np.array([0.0, 3.0, 2.9, -5.0])
    assert _pick(logits, None, 1.0, 1.0) == 1  # greedy: the argmax
    assert {_pick(logits, np.random.default_rng(i), 1.0, 1e-9) for i in range(50)} == {1}  # nucleus of one
    draws = [_pick(logits, np.random.default_rng(i), 1.0, 0.9) for i in range(200)]
    assert set(draws) == {1, 2}  # token 0 holds ~3 % of the mass, outside the 0.9 nucleus; token 3 less
    again = [_pick(logits, np.random.default_rng(i), 1.0, 0.9) for i in range(200)]
    assert draws == again
    hot = [_pick(logits, np.random.default_rng(i), 50.0, 1.0) for i in range(400)]
    assert set(hot) == {0, 1, 2, 3}  # a high temperature flattens the distribution


def test_backend_refusals(digit_model_path, tmp_path):
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", "--backend", "llama.cpp")
    assert r.exit_code == 2 and "--backend llama.cpp runs a .gguf model" in r.output
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", fake, "--teacher-forced")
    assert r.exit_code == 2 and "--teacher-forced reads transformers' logits" in r.output
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", tmp_path / "missing.gguf")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = run_cli("eval", "--model", digit_model_path, "--data", "synthetic", "--backend", "vllm")
    assert r.exit_code == 2 and "eval.backend" in r.output and "Traceback" not in r.output
