"""Issue 14, the wiring: the loss object, training, inspect and eval on tokenizers with number tokens of 1-3
digits (the real Llama-3.2 vocabulary on a tiny random-init Llama), and single-digit tokenizers unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import digit_targets, oracle_digits
from rich.console import Console
from tiny import build_model, build_tokenizer
from torch import nn

from delft.losses.heads import digit_logits
from delft.losses.loss import Loss
from delft.losses.modules import full_logits_loss
from delft.losses.terms import TERMS, del_term
from delft.numbers.tokens import CharTable, NumberVocab, count_digit_chars

TEXTS = ["1234567.89", "x 45", "none", "3.14159", "12 + 7", "0.5", "99999", "a 1.2.3"]
PARAMS = {"dist2": {"tau": 0.5}}


@pytest.fixture(scope="module")
def llama3_model(llama3_tokenizer):
    return build_model(llama3_tokenizer, hidden=16, layers=1)


def batch(tokenizer, texts=TEXTS):
    """(input ids, labels aligned with the hidden states: labels[:, t] is the token after position t)."""
    rows = [tokenizer.encode("Q " + t, add_special_tokens=False) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        labels[b, :len(row) - 1] = torch.tensor(row[1:])
    return ids, labels


# ----------------------------------------------------------------------------- the loss object


@pytest.mark.parametrize("kind", sorted(TERMS))
def test_chunked_equals_full_logits_on_the_llama3_vocabulary(llama3_tokenizer, llama3_vocab, llama3_model, kind):
    ids, labels = batch(llama3_tokenizer)
    loss = Loss(kind, 0.7, llama3_vocab, chunk_size=7, **PARAMS.get(kind, {}))
    hidden = llama3_model.model(ids).last_hidden_state.detach().requires_grad_(True)
    head = llama3_model.lm_head
    full = full_logits_loss(head(hidden), labels, loss)
    g_full = torch.autograd.grad(full["loss"], [hidden, head.weight])
    counts = loss.count(labels)
    sums = loss.sums(hidden, head, labels)
    # N_digits counts digit characters: "1234567.89" is 123|456|7|.|89, nine digits in four tokens
    assert counts.digits == sums.counts.digits == sum(c.isdigit() for t in TEXTS for c in t)
    assert counts.digits > int(torch.isin(labels, torch.tensor(llama3_vocab.ids)).sum())
    chunked = loss.means(sums, counts)
    g_chunk = torch.autograd.grad(chunked["loss"], [hidden, head.weight])
    assert chunked["term"].item() == pytest.approx(full["term"].item(), rel=1e-5) and chunked["term"].item() > 0
    assert chunked["loss"].item() == pytest.approx(full["loss"].item(), rel=1e-5)
    for a, b in zip(g_chunk, g_full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_gradients_equal_for_8x1_4x2_2x4_micro_batches_through_loss(llama3_tokenizer, llama3_vocab, llama3_model):
    ids, labels = batch(llama3_tokenizer)
    loss = Loss("del", 0.5, llama3_vocab, chunk_size=16)
    counts = loss.count(labels)
    grads = []
    for size in (1, 2, 4):
        llama3_model.zero_grad()
        for s in range(0, len(TEXTS), size):
            hidden = llama3_model.model(ids[s:s + size]).last_hidden_state
            sums = loss.sums(hidden, llama3_model.lm_head, labels[s:s + size])
            loss.combine(sums, counts).backward()
        grads.append([p.grad.clone() for p in (llama3_model.lm_head.weight, llama3_model.model.norm.weight)])
    assert grads[0][0].abs().sum() > 0
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_single_digit_tokenizer_is_bit_identical_to_the_ten_digit_path():
    """Loss with a NumberVocab (or the oracle's single digits) gives exactly the ten-digit-logit term and gradients."""
    tok = build_tokenizer()
    numbers = NumberVocab.from_tokenizer(tok)
    ids, labels = batch(tok)
    model = build_model(tok, hidden=16, layers=1)
    hidden = model.model(ids).last_hidden_state.detach().requires_grad_(True)
    for kind in TERMS:
        for vocab in (numbers, NumberVocab.single_digits(numbers.digit_ids, numbers.dot_id)):
            loss = Loss(kind, 1.0, vocab, **PARAMS.get(kind, {}))
            got = loss.sums(hidden, model.lm_head, labels).term
            dt = digit_targets(labels, oracle_digits(numbers))
            want = loss.term(digit_logits(hidden[dt.mask], model.lm_head, numbers.ids), dt.targets, dt.weights).sum()
            assert torch.equal(got, want)
            assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, [hidden, model.lm_head.weight]),
                                                          torch.autograd.grad(want, [hidden, model.lm_head.weight])))
            assert loss.count(labels).digits == len(dt.targets)


def test_a_digit_no_token_offers_counts_zero_in_del():
    """On a vocabulary with gaps a digit logit is -inf; DEL's p * BCE there is 0, not NaN."""
    texts = list("0123456789") + ["12", "123", "129", "45"]
    vocab = NumberVocab(tuple(range(20, 20 + len(texts))), tuple(texts), None)
    assert not CharTable.build(texts).complete
    head = nn.Linear(8, 40, bias=False)
    col = {t: 20 + i for i, t in enumerate(texts)}
    labels = torch.tensor([[col["123"], -100, col["45"]]])  # two numbers: places 3, 2, 1 and 2, 1
    hidden = torch.randn(1, 3, 8, requires_grad=True)
    term = Loss("del", 1.0, vocab).sums(hidden, head, labels).term
    grads = torch.autograd.grad(term, [hidden, head.weight])
    assert torch.isfinite(term) and all(torch.isfinite(g).all() for g in grads) and grads[1].abs().sum() > 0

    z = head(hidden[0]).detach()

    def row(p, members):  # digit d's logit: logsumexp over the tokens members(d); -inf when there are none
        return torch.stack([torch.logsumexp(z[p, [col[t] for t in members(d)]], 0) if members(d) else
                            torch.tensor(float("-inf")) for d in range(10)])

    first = lambda d: [t for t in texts if t[0] == str(d)]
    chars = [(0, first, 1, 6.0), (0, lambda d: ["12", "123", "129"] if d == 2 else [], 2, 4.0),
             (0, lambda d: {3: ["123"], 9: ["129"]}.get(d, []), 3, 2.0),
             (2, first, 4, 4.0), (2, lambda d: ["45"] if d == 5 else [], 5, 2.0)]
    want = 0.0
    for p, members, y, w in chars:
        zz = row(p, members)
        prob = torch.softmax(zz, 0)
        bce = nn.functional.binary_cross_entropy_with_logits(zz, nn.functional.one_hot(torch.tensor(y), 10).float(),
                                                             reduction="none")
        want += w * torch.where(torch.isfinite(zz), prob * bce, 0.0).mean().item()
    assert term.item() == pytest.approx(want, rel=1e-5)
    assert del_term(row(0, chars[1][1])[None], torch.tensor([2]), torch.ones(1)).isnan().all()  # unmasked: NaN


def test_fused_ce_beside_the_per_character_term():
    """Liger's fused CE (Triton interpreter) with the number-token term equals the chunked path."""
    tok = build_tokenizer(chunked_digits=True)
    vocab = NumberVocab.from_tokenizer(tok)
    assert vocab.max_len == 2
    torch.manual_seed(0)
    head = nn.Linear(24, len(tok), bias=False)
    ids, labels = batch(tok, TEXTS[:4])
    hidden = torch.randn(*labels.shape, 24, requires_grad=True)

    from helpers import del_step

    ref, ref_h, ref_w = del_step(vocab, hidden, head, labels, fused=False)
    out, g_h, g_w = del_step(vocab, hidden, head, labels, fused=True)
    assert out.counts.digits == ref.counts.digits == count_digit_chars(labels, vocab) > 10
    torch.testing.assert_close(out.term, ref.term)
    torch.testing.assert_close(out.ce, ref.ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_h, ref_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, ref_w, rtol=1e-4, atol=1e-6)


def test_train_setup_accepts_number_tokens_and_refuses_glued_digits(tmp_path, llama3_model_dir):
    from helpers import recipe_file
    from tiny import save_tiny

    from delft.errors import UserError
    from delft.recipe.files import load_recipe
    from delft.training.setup import setup

    s = setup(load_recipe(recipe_file(tmp_path, llama3_model_dir)))
    assert len(s.loss.numbers.ids) == 1110 and s.loss.numbers.max_len == 3
    glued = save_tiny(tmp_path / "glued", glued_digits=True, hidden=16, layers=1)
    with pytest.raises(UserError, match="glued to other characters"):
        setup(load_recipe(recipe_file(tmp_path, glued, name="g")))
    assert setup(load_recipe(recipe_file(tmp_path, glued, name="c", loss={"type": "ce"}))).loss.numbers is None


# ----------------------------------------------------------------------------- train, inspect, eval


ANSWER = "12345.67"  # 123 | 45 | . | 67 on Llama-3


@pytest.fixture(scope="module")
def llama3_run(llama3_model_dir, tmp_path_factory):
    """A short `delft train` (DEL) of the tiny Llama-3-vocabulary model on answers that are one number."""
    from helpers import recipe_file

    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    tmp = tmp_path_factory.mktemp("llama3run")
    data = tmp / "numbers.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: the total?", "completion": ANSWER}) + "\n"
                            for i in range(24)))
    path = recipe_file(tmp, llama3_model_dir, data={"source": str(data), "format": "prompt_completion",
                                                    "max_length": 24, "val_size": 4},
                       train={"max_steps": 6, "eval_steps": 6, "save_steps": 6, "learning_rate": 5e-2},
                       loss={"type": "del", "weight": 4.0},
                       lora={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"})
    return run_training(load_recipe(path), console=Console(record=True, width=200)), data


@pytest.mark.slow
def test_short_training_lowers_the_digit_term(llama3_run):
    run, _ = llama3_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    terms = [r["term"] for r in rows if "term" in r]
    [val] = [r["val_term"] for r in rows if "val_term" in r]
    assert len(terms) == 6 and val < 0.95 * terms[0], (terms, val)


@pytest.mark.slow
def test_inspect_shows_a_row_per_digit_character(llama3_run, llama3_model_dir, tmp_path):
    from delft.inspection.command import run_inspect

    run, _ = llama3_run
    out = tmp_path / "inspect.json"
    console = Console(record=True, width=200)
    run_inspect(None, "Q1: the total?", None, ["base", str(run)], ANSWER, 8, out, tmp_path / "h.png", [],
                   console)
    data = json.loads(out.read_text())
    assert [m["name"] for m in data["models"]] == ["base", run.name]
    for m in data["models"]:
        [number] = m["numbers"]
        rows = number["positions"]
        assert number["text"] == ANSWER
        assert [(r["text"], r["char_index"], r["char"], r["place"]) for r in rows] == [
            ("123", 0, "1", 5), ("123", 1, "2", 4), ("123", 2, "3", 3), ("45", 0, "4", 2), ("45", 1, "5", 1),
            (".", 0, ".", None), ("67", 0, "6", -1), ("67", 1, "7", -2)]
        assert all(sum(r["probs"]) == pytest.approx(1.0, abs=1e-5) for r in rows)
        assert len({r["token_prob"] for r in rows[:3]}) == 1  # one token, one probability
    base, tuned = ([r["probs"][r["digit"]] for r in m["numbers"][0]["positions"] if r["digit"] is not None]
                   for m in data["models"])
    assert sum(tuned) > sum(base)  # the DEL run moved mass to the answer's digits
    text = console.export_text()
    assert "1[2]3" in text and "4[5]" in text and (tmp_path / "h.png").stat().st_size > 1000
    greedy = run_inspect(None, "Q1: the total?", None, [str(run)], None, 6, None, None, [],
                            Console(record=True, width=200))
    assert greedy.mode == "greedy"


@pytest.mark.slow
def test_eval_runs_on_the_llama3_vocabulary_model(llama3_run, tmp_path):
    from delft.evaluation.command import run_eval

    run, data = llama3_run
    [evaluated] = run_eval(None, [str(run)], None, str(data), "prompt_completion", 4, False, None, None,
                           ["eval.max_new_tokens=8", "eval.batch_size=4", "eval.bootstrap=10"],
                           Console(record=True, width=200), allow_seen=True)  # its own training rows, on purpose
    assert len(evaluated.generated) == len(evaluated.scored) == 4
    # answers are read from the text and places from its characters, whatever the tokens were
    places = evaluated.metrics["per_place"]
    assert set(places) == {"ten-thousands", "thousands", "hundreds", "tens", "units", "tenths", "hundredths"}
    assert all(v["n"] == 4 for v in places.values())


def test_plan_counts_the_number_token_rows(tmp_path, llama3_model_dir):
    from helpers import recipe_file

    from delft.recipe.files import load_recipe
    from delft.planning.memory import plan_memory
    from delft.planning.command import run_plan
    from delft.planning.shapes import with_number_tokens

    recipe = load_recipe(recipe_file(tmp_path, llama3_model_dir, data={"max_length": 256}))
    config = json.loads((llama3_model_dir / "config.json").read_text())
    counted, note = with_number_tokens(config, str(llama3_model_dir / "config.json"))
    assert note == "" and counted["delft_number_tokens"] == 1110
    console = Console(record=True, width=200)
    result = run_plan(recipe, None, console)
    planned, ten = result["components"], plan_memory(config, recipe, result["fused"])
    H, rows = config["hidden_size"], 4 * 256
    assert planned["loss"] - ten["loss"] == 1100 * H * (2 + 4) + rows * 1100 * 12  # dtype auto: bf16 on a GPU
    assert "1,110-row digit term" in console.export_text()
