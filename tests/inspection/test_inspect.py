"""delft inspect: records against an independent full forward pass, table/JSON agreement, compare, CLI."""

from __future__ import annotations

import json
import types

import pytest
import torch
from helpers import run_cli
from rich.console import Console

import delft.inspection.command as inspect_command
from delft.errors import UserError
from delft.inspection.command import run_inspect
from delft.inspection.records import check_target, compute_records, greedy_answer, label_positions, numbers_of
from delft.inspection.render import fmt_argmax, fmt_entropy, fmt_pct, fmt_prob, fmt_token
from delft.numbers.digits import DIGITS
from delft.numbers.tokens import NumberVocab

PROMPT = "What is 5 + 7?"


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def digit_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with large output rows for the digits and '.', so its greedy answers are numbers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = NumberVocab.from_tokenizer(tok)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = model.lm_head.weight
        for i in list(vocab.digit_ids) + [vocab.dot_id]:
            w[i] = torch.randn(w.shape[1], generator=gen) * 3
    out = tmp_path_factory.mktemp("digity") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A run directory with a LoRA adapter whose B is nonzero (so it changes the model) and delft_run.json."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from delft.rundir import RUN_INFO, architecture

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    arch = architecture(base.config)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    run = tmp_path_factory.mktemp("runs") / "del"
    peft_model.save_pretrained(run)
    (run / RUN_INFO).write_text(json.dumps({"base_model": str(tiny_model_dir), "architecture": arch}))
    return run


def reference(model, tokenizer, prompt_text: str, answer_ids: list[int]):
    """Independent numbers: one plain forward pass with full logits, softmaxes taken by hand."""
    vocab = NumberVocab.from_tokenizer(tokenizer)
    p_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([p_ids + answer_ids])).logits[0].double()
    rows = logits[len(p_ids) - 1: len(p_ids) - 1 + len(answer_ids)]
    full = torch.softmax(rows, dim=-1)
    digits = torch.softmax(rows[:, list(vocab.digit_ids)], dim=-1)
    mass = full[:, list(vocab.digit_ids)].sum(-1)
    tok_p = full[torch.arange(len(answer_ids)), answer_ids]
    return digits, mass, tok_p, full


def chat_prompt(tokenizer, prompt=PROMPT):
    from delft.data.sources import Example
    from delft.data.prompts import render_prompt
    from delft.recipe.schema import DataConfig

    return render_prompt(Example(prompt, ""), tokenizer, DataConfig())


def table_lines(text: str) -> dict[str, list[str]]:
    """Data rows of an exported single-model table, keyed by place label: [10 cells, entropy, mass, p(token)]."""
    out = {}
    names = ("units", "tens", "hundreds", "thousands", "tenths", "hundredths", "point", "millions", "10^")
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0].startswith(names) and len(parts) >= 14:
            out[parts[0]] = parts[1:14]
    return out


# ------------------------------------------------------------------------------------------ numbers


def test_teacher_forced_records_match_full_forward(tiny):
    model, tok = tiny
    prompt_text = chat_prompt(tok)
    answer = tok.encode("-1,234.56 ok", add_special_tokens=False)
    records = compute_records(model, tok, prompt_text, answer)
    digits, mass, tok_p, full = reference(model, tok, prompt_text, answer)
    assert len(records) == len(answer)
    for i, r in enumerate(records):
        assert r.token_id == answer[i]
        assert r.probs == pytest.approx(digits[i].tolist(), abs=1e-5)
        assert sum(r.probs) == pytest.approx(1.0, abs=1e-5)
        assert r.digit_mass == pytest.approx(mass[i].item(), abs=1e-5)
        assert r.token_prob == pytest.approx(tok_p[i].item(), abs=1e-6)
        assert r.top_token_id == int(full[i].argmax())
        assert r.argmax_digit == int(digits[i].argmax())
        p = digits[i]
        assert r.entropy == pytest.approx(float(-(p * torch.log2(p)).sum()), abs=1e-4)
    shown = [(r.char, r.kind, r.place_name) for r in records if r.kind]
    assert shown == [("1", "digit", "thousands"), ("2", "digit", "hundreds"), ("3", "digit", "tens"),
                     ("4", "digit", "units"), (".", "point", None), ("5", "digit", "tenths"),
                     ("6", "digit", "hundredths")]
    numbers = numbers_of(records)
    assert [n.text for n in numbers] == ["-1,234.56"]


def test_fallback_without_logits_to_keep_gives_the_same_numbers(tiny, monkeypatch):
    model, tok = tiny
    prompt_text = chat_prompt(tok)
    answer = tok.encode("391", add_special_tokens=False)
    expected = compute_records(model, tok, prompt_text, answer)
    import inspect as pyinspect

    monkeypatch.setattr(pyinspect, "signature", lambda f: types.SimpleNamespace(parameters={}))
    got = compute_records(model, tok, prompt_text, answer)
    for a, b in zip(expected, got):
        assert a.probs == pytest.approx(b.probs, abs=1e-5)
        assert a.token_prob == pytest.approx(b.token_prob, abs=1e-6)


def test_greedy_records_match_full_forward(digit_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(digit_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(digit_model_dir)
    prompt_text = chat_prompt(tok)
    answer = greedy_answer(model, tok, prompt_text, 6, chat=True).answer_ids
    assert 0 < len(answer) <= 6
    records = compute_records(model, tok, prompt_text, answer)
    digits, mass, tok_p, full = reference(model, tok, prompt_text, answer)
    assert any(r.kind == "digit" for r in records)
    for i, r in enumerate(records):
        assert r.token_id == int(full[i].argmax()) == r.top_token_id  # greedy: the answer is the argmax
        assert r.probs == pytest.approx(digits[i].tolist(), abs=1e-5)
        assert r.digit_mass == pytest.approx(mass[i].item(), abs=1e-5)
        assert r.token_prob == pytest.approx(tok_p[i].item(), abs=1e-6)
        assert fmt_argmax(r) == ""


def test_places_dots_and_separators(tiny_tokenizer):
    vocab = NumberVocab.from_tokenizer(tiny_tokenizer)

    def label(text):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        texts = [tiny_tokenizer.decode([t]) for t in ids]
        kind, number, place = label_positions(ids, texts, vocab)
        return [(c, k, n, p) for c, k, n, p in zip(texts, kind, number, place) if k]

    assert label("It is 391.") == [("3", "digit", 0, 3), ("9", "digit", 0, 2), ("1", "digit", 0, 1)]
    assert label("1,234,567") == [(c, "digit", 0, 7 - i) for i, c in enumerate("1234567")]
    assert label("1,23 and 4.5") == [("1", "digit", 0, 1), ("2", "digit", 1, 2), ("3", "digit", 1, 1),
                                     ("4", "digit", 2, 1), (".", "point", 2, None), ("5", "digit", 2, -1)]
    assert label("... no") == []
    # a ',' after a non-digit is not a thousands separator (it used to raise a TypeError)
    assert label("x,123 and ,456") == [(c, "digit", n, p) for n, run in enumerate(("123", "456"))
                                       for c, p in zip(run, (3, 2, 1))]


# -------------------------------------------------------------------------------------- table and JSON


def test_table_and_json_agree(tiny_model_dir, tmp_path):
    console = Console(record=True, width=200)
    out = tmp_path / "out.json"
    plot = tmp_path / "plots" / "out.png"
    result = run_inspect(None, PROMPT, str(tiny_model_dir), [], "12.5", 8, out, plot, [], console)
    text = console.export_text()
    data = json.loads(out.read_text())
    assert plot.stat().st_size > 1000
    assert data["mode"] == "target" and data["answer"] == "12.5" and data["digits"] == DIGITS
    [m] = data["models"]
    assert m["template"] == "chat" and m["prompt_text"].startswith("<|user|>")
    [number] = m["numbers"]
    assert number["text"] == "12.5"
    assert [p["place_name"] for p in number["positions"]] == ["tens", "units", None, "tenths"]
    assert [p["kind"] for p in number["positions"]] == ["digit", "digit", "point", "digit"]
    header = next(line for line in text.splitlines() if line.split()[:1] == ["place"])
    assert header.split() == ["place", *DIGITS, "entropy", "P(digits)", "p(token)", "argmax"]
    assert "number 1 of 1: 12.5" in text and "teacher-forced on --target 12.5" in text
    rows = table_lines(text)
    assert set(rows) == {"tens", "units", "point", "tenths"}
    for p in number["positions"]:
        row = rows[p["place_name"] or "point"]
        expected = [fmt_prob(q, marked=(d == p["digit"])) for d, q in enumerate(p["probs"])]
        assert row[:10] == expected
        assert row[10:] == [fmt_entropy(p["entropy"]), fmt_pct(p["digit_mass"]), fmt_pct(p["token_prob"])]
        if p["digit"] is not None:
            assert row[p["digit"]].startswith("[") and sum(c.startswith("[") for c in row[:10]) == 1
            assert p["char"] == str(p["digit"])
        else:
            assert not any(c.startswith("[") for c in row[:10])
        assert p["argmax_digit"] == max(range(10), key=lambda d: p["probs"][d])
    # JSON holds what the records hold
    assert number["positions"][0]["probs"] == result.models[0].numbers[0].rows[0].probs


def test_narrow_console_keeps_every_digit_cell(tiny_model_dir):
    console = Console(record=True, width=80)
    result = run_inspect(None, PROMPT, str(tiny_model_dir), [], "-1,234.5", 4, None, None, [], console)
    text = console.export_text()
    assert "…" not in text
    header = next(line for line in text.splitlines() if line.split()[:1] == ["place"])
    assert header.split()[:15] == ["place", *DIGITS, "H", "P(d)", "p(t)", "argmax"]
    rows = table_lines(text)
    for r in result.models[0].numbers[0].rows:
        assert rows[r.place_name or "point"][:10] == [fmt_prob(q, r.digit == d) for d, q in enumerate(r.probs)]


def test_plain_template_prompt(tiny_model_dir):
    result = run_inspect(None, PROMPT, str(tiny_model_dir), [], "7", 4, None, None, ["data.template=plain"],
                            Console(record=True, width=200))
    assert result.models[0].template == "plain"
    assert result.models[0].prompt_text == PROMPT + "\n"


def test_greedy_run_renders_the_answer(digit_model_dir):
    console = Console(record=True, width=200)
    result = run_inspect(None, PROMPT, str(digit_model_dir), [], None, 5, None, None, [], console)
    text = console.export_text()
    assert result.mode == "greedy" and result.has_digits
    assert f"greedy answer of {digit_model_dir.name}" in text
    assert f"number 1 of {len(result.models[0].numbers)}" in text


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", ["abc", "3/4", "12 apples", "1,23", "", "$5", "1e5"])
def test_target_not_a_number(bad, tiny_model_dir):
    with pytest.raises(UserError, match="target is not a number"):
        run_inspect(None, PROMPT, str(tiny_model_dir), [], bad, 4, None, None, [], Console(record=True))


@pytest.mark.parametrize("good", ["391", "-3.5", "1,234", "+0.25", ".5", " 7 "])
def test_target_numbers_accepted(good):
    assert check_target(good) == good.strip()


def test_answer_without_digits(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    from delft.evaluation.generation import Generation

    ids = tiny_tokenizer.encode("no idea", add_special_tokens=False)
    monkeypatch.setattr(inspect_command, "greedy_answer", lambda model, tok, prompt_text, n, chat: Generation(
        ids, ids, "no idea", "no idea"))
    console = Console(record=True, width=200)
    out = tmp_path / "none.json"
    plot = tmp_path / "none.png"
    result = run_inspect(None, PROMPT, str(tiny_model_dir), [], None, 8, out, plot, [], console)
    text = console.export_text()
    assert not result.has_digits
    assert "the answer has no digits" in text and "--target" in text and "'no idea'" in text
    assert json.loads(out.read_text())["models"][0]["numbers"] == []
    assert not plot.exists()


def test_two_digit_tokens_get_a_row_per_character(tmp_path):
    from tiny import save_tiny

    path = save_tiny(tmp_path / "chunked", chunked_digits=True, hidden=16, layers=1)
    console = Console(record=True, width=200)
    result = run_inspect(None, PROMPT, str(path), [], "123.45", 4, None, None, [], console)
    rows = result.models[0].numbers[0].rows
    assert [(fmt_token(r), r.place_name) for r in rows] == [
        ("[1]2", "hundreds"), ("1[2]", "tens"), ("3", "units"), (".", None), ("[4]5", "tenths"),
        ("4[5]", "hundredths")]
    assert all(sum(r.probs) == pytest.approx(1.0, abs=1e-5) for r in rows)
    header = next(line for line in console.export_text().splitlines() if line.split()[:1] == ["place"])
    assert header.split()[:3] == ["place", "token", "0"]


def test_glued_digit_tokenizer_is_refused(tmp_path):
    from tiny import save_tiny

    path = save_tiny(tmp_path / "glued", glued_digits=True, hidden=16, layers=1)
    with pytest.raises(UserError, match="glued"):
        run_inspect(None, PROMPT, str(path), [], "12", 4, None, None, [], Console(record=True))


def test_no_model_and_missing_run(tmp_path):
    with pytest.raises(UserError, match="no model given"):
        run_inspect(None, PROMPT, None, [], "12", 4, None, None, [], Console(record=True))
    with pytest.raises(UserError, match="does not exist"):
        run_inspect(None, PROMPT, None, [str(tmp_path / "nope")], "12", 4, None, None, [], Console(record=True))


# --------------------------------------------------------------------------------------------- compare


def test_compare_base_and_adapter(tiny_model_dir, adapter_dir, tmp_path):
    console = Console(record=True, width=200)
    out = tmp_path / "cmp.json"
    plot = tmp_path / "cmp.png"
    # 'base' = the base recorded in the run; the tiny model directory itself counts as a merged model
    result = run_inspect(None, PROMPT, None, ["base", str(adapter_dir), str(tiny_model_dir)], "12", 8, out,
                            plot, [], console)
    data = json.loads(out.read_text())
    names = [m["name"] for m in data["models"]]
    assert names == ["base", "del", "model"]
    base, lora, merged = ([q for p in m["numbers"][0]["positions"] for q in p["probs"]] for m in data["models"])
    assert base == pytest.approx(merged, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(base, lora)) > 1e-3
    assert plot.stat().st_size > 1000
    text = console.export_text()
    header = next(line for line in text.splitlines() if line.split()[:1] == ["place"])
    assert header.split()[:3] == ["place", "model", "0"]
    # sub-rows: every position shows each model once, the place label on the first
    lines = [line.split() for line in text.splitlines()]
    tens = next(i for i, parts in enumerate(lines) if parts[:2] == ["tens", "base"])
    assert lines[tens + 1][0] == "del" and lines[tens + 2][0] == "model"
    for m, row in zip(data["models"], (lines[tens][2:12], lines[tens + 1][1:11], lines[tens + 2][1:11])):
        p = m["numbers"][0]["positions"][0]
        assert row == [fmt_prob(q, marked=(d == 1)) for d, q in enumerate(p["probs"])]
    assert result.models[1].adapter == str(adapter_dir)


def test_compare_greedy_uses_first_models_answer(digit_model_dir, adapter_dir, tmp_path):
    console = Console(record=True, width=200)
    out = tmp_path / "greedy.json"
    # a merged model first (its greedy answer), then an adapter whose base comes from its delft_run.json
    result = run_inspect(None, PROMPT, None, [str(digit_model_dir), str(adapter_dir)], None, 4, out, None,
                            [], console)
    text = console.export_text()
    assert result.models[1].answer_ids == result.models[0].answer_ids
    assert "teacher-forced for every model" in text
    assert result.models[1].own_answer is not None and "del's own greedy answer" in text
    data = json.loads(out.read_text())
    assert data["models"][1]["own_greedy_answer"] == result.models[1].own_answer
    assert len(result.models[0].answer_ids) == 4 and result.models[0].records[-1].kind == "digit"
    assert "cut by --max-new-tokens 4" in text and data["notes"]


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_target_json(tiny_model_dir, tmp_path):
    out = tmp_path / "cli.json"
    res = run_cli("inspect", "--model", str(tiny_model_dir), "--target", "12", "--json", str(out), PROMPT)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["target"] == "12" and len(data["models"][0]["numbers"][0]["positions"]) == 2
    bad = run_cli("inspect", "--model", str(tiny_model_dir), "--target", "twelve", PROMPT)
    assert bad.exit_code == 2


# ------------------------------------------------------------------------------------ eval and inspect


@pytest.mark.parametrize("template", ["chat", "plain"])
def test_eval_and_inspect_give_the_same_answer(tiny_model_dir, tmp_path, template):
    """One generator (delft.evaluation.generation): eval extracts from the very answer text that inspect shows."""
    from delft.evaluation.command import run_eval
    from delft.numbers.answers import cut_at_stop, extract_answer

    prompts = [PROMPT, "What is 12 * 34?", "Q: 1,250.5 - 93 ="]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": "1"}) + "\n" for p in prompts))
    overrides = [f"data.template={template}", "eval.max_new_tokens=24", "eval.batch_size=2", "eval.bootstrap=10"]
    [evaluated] = run_eval(None, [], str(tiny_model_dir), str(data), "prompt_completion", None, True, None, None,
                           overrides, Console(record=True, width=200))
    assert evaluated.template == template
    as_data = overrides + [f"data.source={data}", "data.format=prompt_completion"]  # its prompts as eval's
    for prompt, rendered, generated in zip(prompts, evaluated.prompts, evaluated.generated):
        result = run_inspect(None, prompt, str(tiny_model_dir), [], None, 24, None, None, as_data,
                             Console(record=True, width=200))
        view = result.models[0]
        assert view.prompt_text == rendered and view.template == template
        assert result.answer == cut_at_stop(generated, evaluated.stop_strings)
        assert extract_answer(result.answer, evaluated.stop_strings).value == extract_answer(generated, evaluated.stop_strings).value
