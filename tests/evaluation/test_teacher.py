"""delft eval --teacher-forced on tiny models: every number equals a direct computation from full logits."""

import json
import math

import pytest
import torch
from helpers import DATA, OracleDigits
from rich.console import Console
from tiny import save_tiny

import delft.evaluation.teacher_forced as teacher_mod
from delft.data.batches import tokenize_example
from delft.evaluation.command import run_eval
from delft.numbers.digits import place_name
from delft.numbers.tokens import IGNORE
from delft.recipe.schema import DataConfig

FAST = ["eval.max_new_tokens=3", "eval.batch_size=3", "eval.bootstrap=200"]
GSM8K = DATA / "gsm8k_test.jsonl"


def _brute_force(model, tokenizer, examples, data_cfg) -> dict:
    """Pooled teacher-forced metrics from the full [T, V] logits of one example at a time."""
    vocab = OracleDigits.from_tokenizer(tokenizer)  # the tests' own single-digit probe, not delft's
    digit_ids = torch.tensor(vocab.digit_ids)
    per_place, text, digits = {}, [], []
    for ex in examples:
        tok = tokenize_example(ex, tokenizer, data_cfg)
        with torch.no_grad():
            logits = model(torch.tensor([tok.input_ids])).logits[0, :-1].float()
        targets = tok.labels[1:]
        places = vocab.places(targets)
        for t, (y, place) in enumerate(zip(targets, places)):
            if y == IGNORE:
                continue
            ce = float(torch.logsumexp(logits[t], 0) - logits[t, y])
            if place is None:
                text.append(ce)
                continue
            z = logits[t, digit_ids]
            d = vocab.digit_ids.index(y)
            row = (float(z.argmax() == d), float(logits[t].argmax() == y), float(torch.logsumexp(z, 0) - z[d]))
            per_place.setdefault(place, []).append(row)
            digits.append(row)
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {"digits": {m: mean(digits, k) for k, m in enumerate(teacher_mod.DIGIT_METRICS)} | {"n": len(digits)},
            "per_place": {place_name(p): {m: mean(rows, k) for k, m in enumerate(teacher_mod.DIGIT_METRICS)}
                          | {"n": len(rows)} for p, rows in per_place.items()},
            "text": {"n": len(text), "ce": sum(text) / len(text), "perplexity": math.exp(sum(text) / len(text))}}


def _close(got: dict, want: dict):
    for key, value in want.items():
        if isinstance(value, dict):
            _close(got[key], value)
        else:
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_teacher_forced_equals_full_logits(tiny_model_dir, tiny_lora_run, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.data.pipeline import load_examples

    monkeypatch.setattr(teacher_mod, "CHUNK_POSITIONS", 7)  # many chunks per batch: their seams must not show
    out, png = tmp_path / "eval.json", tmp_path / "places.png"
    console = Console(width=200, record=True)
    run_eval(runs=[str(tiny_lora_run)], model=str(tiny_model_dir), data=str(GSM8K), data_format="gsm8k",
             json_out=out, plot=png, overrides=FAST + ["data.max_length=500"], console=console, teacher_forced=True)
    report = json.loads(out.read_text())
    assert report["settings"]["teacher_forced"] is True
    data_cfg = DataConfig(source=str(GSM8K), format="gsm8k", max_length=500)
    examples = load_examples(data_cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    want_base = _brute_force(base, tokenizer, examples, data_cfg)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tiny_lora_run)).eval()
    want_run = _brute_force(tuned, tokenizer, examples, data_cfg)
    got_base, got_run = (m["teacher_forced"] for m in report["models"])
    _close(got_base, want_base)
    _close(got_run, want_run)
    assert got_base["n_examples"] == len(examples) and got_base["truncated"] == 2  # two rows pass 500 tokens
    assert {p["place"] for p in got_base["per_place"].values()} >= {1, 2}
    assert want_base["text"]["ce"] != pytest.approx(want_run["text"]["ce"])  # the adapter changes the model
    for group, metric, a, b in (("digits", "digit_ce", want_base["digits"]["digit_ce"], want_run["digits"]["digit_ce"]),
                                ("text", "text_ce", want_base["text"]["ce"], want_run["text"]["ce"])):
        d = got_run["vs_base"][group][metric]
        assert d["difference"] == pytest.approx(b - a, rel=1e-4)
        assert d["ci"][0] <= d["difference"] <= d["ci"][1]
    assert got_base["vs_base"] is None
    assert png.is_file() and teacher_mod.teacher_plot_path(png).read_bytes()[:4] == b"\x89PNG"
    shown = console.export_text()
    assert "teacher-forced on the gold completions" in shown and "non-digit perplexity" in shown
    assert "lora vs base (teacher-forced, paired bootstrap)" in shown


def test_long_numbers_reach_the_twentieth_place(tiny_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    overrides = FAST + ["data.synthetic.ops=[copy]", "data.synthetic.min_digits=21", "data.synthetic.max_digits=21",
                        "data.synthetic.decimal_fraction=0"]
    console = Console(width=200, record=True)
    run_eval(model=str(tiny_model_dir), data="synthetic", limit=3, json_out=out, overrides=overrides,
             console=console, teacher_forced=True)
    model = json.loads(out.read_text())["models"][0]
    assert all(p["prompt"].count("Repeat ") == 1 for p in model["predictions"])
    want = {place_name(p) for p in range(1, 22)}
    assert set(model["metrics"]["per_place"]) == want == set(model["teacher_forced"]["per_place"])
    assert model["teacher_forced"]["per_place"]["10^19"]["n"] == 3
    assert "10^19 (n=3)" in console.export_text()


def _brute_force_chars(model, tokenizer, examples, data_cfg) -> dict:
    """Teacher-forced digit metrics per digit character on a tokenizer with multi-digit number tokens, from full
    logits: at character j of gold token g, digit d's logit is the logsumexp over the number tokens that share g's
    first j characters and have d at j (an independent, loop-by-loop reading of the per-character rule)."""
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    numbers = {i: t for i, t in texts.items() if t.isdigit() and tokenizer.encode(t, add_special_tokens=False) == [i]}
    digits, text = [], []
    for ex in examples:
        tok = tokenize_example(ex, tokenizer, data_cfg)
        with torch.no_grad():
            logits = model(torch.tensor([tok.input_ids])).logits[0, :-1].float()
        for t, y in enumerate(tok.labels[1:]):
            if y == IGNORE:
                continue
            ce = float(torch.logsumexp(logits[t], 0) - logits[t, y])
            if y not in numbers:
                text.append(ce)
                continue
            g = numbers[y]
            for j, gd in enumerate(g):
                z = torch.stack([torch.logsumexp(torch.stack([logits[t, i] for i, s in numbers.items()
                                                              if len(s) > j and s[:j] == g[:j] and s[j] == d]
                                                             or [torch.tensor(float("-inf"))]), 0)
                                 for d in "0123456789"])
                k = int(gd)
                digits.append((float(z.argmax() == k), float(logits[t].argmax() == y),
                               float(torch.logsumexp(z, 0) - z[k])))
    mean = lambda k: sum(r[k] for r in digits) / len(digits)  # noqa: E731
    return {"digits": {m: mean(k) for k, m in enumerate(teacher_mod.DIGIT_METRICS)} | {"n": len(digits)},
            "text": {"n": len(text), "ce": sum(text) / len(text)}}


def test_teacher_forced_scores_every_digit_of_multi_digit_number_tokens(tmp_path):
    """Llama-3-style tokenizers (numbers as tokens of up to 2 digits here): digit metrics per digit character,
    equal to the brute-force per-character reading of the full logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.data.pipeline import load_examples

    chunked = save_tiny(tmp_path / "chunked", chunked_digits=True)
    out = tmp_path / "eval.json"
    run_eval(model=str(chunked), data=str(GSM8K), data_format="gsm8k", limit=4, json_out=out,
             overrides=FAST + ["data.max_length=300"], console=Console(width=200), teacher_forced=True)
    got = json.loads(out.read_text())["models"][0]["teacher_forced"]
    data_cfg = DataConfig(source=str(GSM8K), format="gsm8k", max_length=300)
    tokenizer = AutoTokenizer.from_pretrained(chunked)
    assert len(tokenizer.encode("1234", add_special_tokens=False)) == 2  # the numbers really are chunked
    want = _brute_force_chars(AutoModelForCausalLM.from_pretrained(chunked).eval(), tokenizer,
                              load_examples(data_cfg)[:4], data_cfg)
    assert got["digits"]["n"] == want["digits"]["n"] > 0
    _close(got["digits"], want["digits"])
    _close({k: got["text"][k] for k in ("n", "ce")}, want["text"])


