"""Number tokens (issue 14): probing tokenizers, per-character digit logits, places across tokens."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import OracleDigits
from tiny import build_model, build_tokenizer

from delft.errors import UserError
from delft.numbers.digits import DIGITS, token_places
from delft.numbers.tokens import CharTable, NumberVocab, char_logits, count_digit_chars, number_targets


def columns(vocab: NumberVocab, texts) -> torch.Tensor:
    return torch.tensor([vocab.texts.index(s) for s in texts])


def brute_force(z: torch.Tensor, gold: list[str], texts) -> list[list[list[float]]]:
    """Oracle: per gold character, P(digit | first j chars), summing token probabilities one by one."""
    out = []
    for p, g in enumerate(gold):
        probs = torch.softmax(z[p], dim=0).tolist()
        rows = []
        for j in range(len(g)):
            mass = [0.0] * 10
            for u, pu in zip(texts, probs):
                if len(u) > j and u[:j] == g[:j]:
                    mass[int(u[j])] += pu
            rows.append([m / sum(mass) for m in mass])
        out.append(rows)
    return out


# ----------------------------------------------------------------------------- probing


def test_llama3_has_1110_number_tokens_of_one_to_three_digits(llama3_tokenizer, llama3_vocab):
    every = {f"{n:0{k}d}" for k in (1, 2, 3) for n in range(10 ** k)}
    assert len(llama3_vocab.ids) == 1110 and set(llama3_vocab.texts) == every
    assert llama3_vocab.texts[:10] == tuple(DIGITS) and llama3_vocab.max_len == 3
    assert not llama3_vocab.is_single_digit
    assert llama3_tokenizer.decode([llama3_vocab.dot_id]) == "."
    ids = llama3_tokenizer.encode("1234567.89", add_special_tokens=False)
    assert [llama3_vocab.text_of(t) for t in ids] == ["123", "456", "7", ".", "89"]
    assert llama3_vocab.places(ids) == [(7, 6, 5), (4, 3, 2), (1,), (None,), (-1, -2)]
    assert [llama3_vocab.text_of(t) for t in llama3_vocab.digit_ids] == list(DIGITS)
    with pytest.raises(ValueError):
        NumberVocab.single_digits(llama3_vocab.ids[:9])


def test_single_digit_tokenizer_gives_todays_digit_ids():
    tok = build_tokenizer()
    vocab = NumberVocab.from_tokenizer(tok)
    assert vocab.is_single_digit and vocab.max_len == 1
    oracle = OracleDigits.from_tokenizer(tok)  # the independent single-digit probe of the test helpers
    assert (vocab.digit_ids, vocab.dot_id) == (oracle.digit_ids, oracle.dot_id)
    colon = tok.convert_tokens_to_ids(":")  # ':' alone ends a count prefix's counts
    assert NumberVocab.single_digits(oracle.digit_ids, oracle.dot_id, oracle.comma_id, colon) == vocab


def test_chunked_tiny_tokenizer_has_110_number_tokens():
    tok = build_tokenizer(chunked_digits=True)
    vocab = NumberVocab.from_tokenizer(tok)
    assert len(vocab.ids) == 110 and vocab.max_len == 2
    ids = tok.encode("x 12345", add_special_tokens=False)
    assert [vocab.text_of(t) for t in ids] == [None, None, "12", "34", "5"]


def _bpe_tokenizer(extra: list[str], isolate_digits: bool):
    """A character-level BPE plus merged tokens ``extra``; optionally a pre-tokenizer that isolates digits."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(c for c in string.printable if c not in "\r\x0b\x0c")}
    merges = []
    for word in extra:
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                vocab[word[:k]] = len(vocab)
                merges.append((word[:k - 1], word[k - 1]))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.decoder = decoders.Fuse()
    if isolate_digits:
        core.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_gpt2_like_glued_digits_are_refused_with_examples():
    tok = _bpe_tokenizer([" 2019", "x2"], isolate_digits=False)
    with pytest.raises(UserError) as err:
        NumberVocab.from_tokenizer(tok, purpose="DEL")
    msg = str(err.value)
    assert "' 2019'" in msg and "'x2'" in msg and "DEL is undefined" in msg and "loss.type: ce" in msg


def test_glued_entries_the_pre_tokenizer_never_emits_are_harmless():
    tok = _bpe_tokenizer([" 2019", "x2"], isolate_digits=True)  # Qwen2-like: \p{N} split off first
    assert tok.convert_ids_to_tokens(tok.encode("x2 2019")) == ["x", "2", " ", "2", "0", "1", "9"]
    assert NumberVocab.from_tokenizer(tok).is_single_digit


def test_a_digit_without_its_own_token_is_refused():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>"] + [c for c in "0123456890abc ."])}  # no '7'
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")))
    with pytest.raises(UserError, match="no single token for the digit"):
        NumberVocab.from_tokenizer(tok)


# ----------------------------------------------------------------------------- places across tokens


def test_places_of_123_45_equal_places_of_single_digits(llama3_tokenizer, llama3_vocab):
    chunked = llama3_vocab.places(llama3_tokenizer.encode("12345", add_special_tokens=False))
    assert chunked == [(5, 4, 3), (2, 1)]
    single = NumberVocab.from_tokenizer(build_tokenizer())
    tok = build_tokenizer()
    ones = single.places(tok.encode("12345", add_special_tokens=False))
    assert [p for t in chunked for p in t] == [p for t in ones for p in t] == [5, 4, 3, 2, 1]
    ids = tok.encode("a 3.25 b 12", add_special_tokens=False)  # today's per-token places, one char each
    assert [p[0] if p else None for p in single.places(ids)] == OracleDigits.from_tokenizer(tok).places(ids)


def test_places_follow_the_run_rules_across_tokens(llama3_vocab):
    assert token_places(["3", ".", "141", "59"]) == [(1,), (None,), (-1, -2, -3), (-4, -5)]
    assert token_places(["12", None, "345"]) == [(2, 1), (), (3, 2, 1)]  # an ignored label ends a run
    assert token_places([".", "5"]) == [(None,), (1,)]  # a leading dot is no decimal point
    ids = [llama3_vocab.ids[llama3_vocab.texts.index(s)] for s in ("123", "45")]
    assert llama3_vocab.places([ids[0], -100, ids[1]]) == [(3, 2, 1), (), (2, 1)]


# ----------------------------------------------------------------------------- per-character logits


def test_per_character_softmax_equals_brute_force_oracle(llama3_vocab):
    gold = ["123", "45", "7", "09", "100", "999", "0", "450"]
    z = torch.randn(len(gold), len(llama3_vocab.ids), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    z = z * 3
    got = char_logits(z, columns(llama3_vocab, gold), llama3_vocab.char_table())
    want = [row for rows in brute_force(z, gold, llama3_vocab.texts) for row in rows]
    assert got.logits.shape == (sum(map(len, gold)), 10)
    torch.testing.assert_close(torch.softmax(got.logits, dim=-1), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)
    assert got.pos.tolist() == [p for p, g in enumerate(gold) for _ in g]
    assert got.char.tolist() == [j for g in gold for j in range(len(g))]
    assert got.digit.tolist() == [int(c) for g in gold for c in g]


def _logits_with(vocab: NumberVocab, rows: int, values: dict[str, float]) -> torch.Tensor:
    z = torch.zeros(rows, len(vocab.ids), dtype=torch.float64)
    for text, v in values.items():
        z[:, vocab.texts.index(text)] = v
    return z


def test_hand_worked_123_45(llama3_vocab):
    # exp-logits: "123" -> 10, "12" -> 2, every other number token -> 1
    z = _logits_with(llama3_vocab, 2, {"123": math.log(10), "12": math.log(2)})
    got = char_logits(z, columns(llama3_vocab, ["123", "45"]), llama3_vocab.char_table()).logits.exp()
    first = [111.0] * 10
    first[1] = 109 + 2 + 10  # the 111 tokens starting with '1', two of them reweighted
    second_1 = [11.0] * 10
    second_1[2] = 2 + 9 + 10  # "12" and "12x" (x = 0..9, "123" weighs 10), among tokens starting "1"
    third = [10.0 if d == 3 else 1.0 for d in range(10)]  # "120".."129"; "12" has no third character
    want = [first, second_1, third, first, [11.0] * 10]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.softmax(got.log()[2], 0)[3].item() == pytest.approx(10 / 19)


def test_hand_worked_3_dot_141_59(llama3_tokenizer, llama3_vocab):
    ids = llama3_tokenizer.encode("3.14159", add_special_tokens=False)
    assert [llama3_vocab.text_of(t) for t in ids] == ["3", ".", "141", "59"]
    assert llama3_vocab.places(ids) == [(1,), (None,), (-1, -2, -3), (-4, -5)]
    gold = [llama3_vocab.text_of(t) for t in ids if llama3_vocab.column_of(t) is not None]
    z = _logits_with(llama3_vocab, 3, {"3": math.log(2), "141": math.log(5), "59": math.log(3)})
    got = char_logits(z, columns(llama3_vocab, gold), llama3_vocab.char_table()).logits.exp()
    first = [111.0] * 10
    first[3], first[1], first[5] = 112.0, 115.0, 113.0
    after_1 = [11.0] * 10
    after_1[4] = 1 + 9 + 5  # "14", "14x" with "141" weighing 5
    after_14 = [5.0 if d == 1 else 1.0 for d in range(10)]
    after_5 = [11.0] * 10
    after_5[9] = 3 + 10  # "59" weighs 3, "590".."599"
    want = [first, first, after_1, after_14, first, after_5]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def test_single_digit_tokenizer_char_logits_are_the_ten_digit_logits_exactly():
    vocab = NumberVocab.from_tokenizer(build_tokenizer())
    z = torch.randn(7, 10, generator=torch.Generator().manual_seed(1))
    gold = torch.tensor([3, 0, 9, 9, 1, 5, 2])
    got = char_logits(z, gold, vocab.char_table())
    assert torch.equal(got.logits, z) and torch.equal(got.digit, gold) and torch.equal(got.pos, torch.arange(7))


SPARSE = list(DIGITS) + ["12", "123", "129", "45", "450", "99"]  # most cells empty: -inf digits


def test_incomplete_vocabulary_gives_minus_inf_and_finite_gradients():
    table = CharTable.build(SPARSE)
    z = torch.randn(3, len(SPARSE), dtype=torch.float64, requires_grad=True)
    got = char_logits(z, torch.tensor([SPARSE.index(s) for s in ("123", "45", "7")]), table)
    assert got.logits.shape == (6, 10)
    assert torch.isinf(got.logits[1]).sum() == 9 and torch.isfinite(got.logits[1, 2])  # after "1": only "12x"
    assert torch.isinf(got.logits[2]).sum() == 8  # after "12": "123" and "129"
    torch.softmax(got.logits, dim=-1)[:, 3].sum().backward()
    assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0


@pytest.mark.parametrize("texts", [SPARSE, [f"{n:0{k}d}" for k in (1, 2) for n in range(10 ** k)]])
def test_gradcheck_float64(texts):
    table = CharTable.build(texts)
    gold = torch.tensor([texts.index(s) for s in ("12", "45", "7", "99")])
    z = torch.randn(4, len(texts), dtype=torch.float64, requires_grad=True)

    def finite(x):
        out = char_logits(x, gold, table).logits
        return torch.where(torch.isfinite(out), out, 0.0)

    assert torch.autograd.gradcheck(finite, (z,))


def test_tiny_llama3_model_number_rows_only(llama3_tokenizer, llama3_vocab):
    """A random-init tiny Llama on the real vocabulary: number rows of the head give the same char logits."""
    model = build_model(llama3_tokenizer, hidden=16, layers=1).double()
    ids = torch.tensor([llama3_tokenizer.encode("total 1234567.89 and 3.14159", add_special_tokens=False)])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    labels = ids[0, 1:]  # position t scores token t + 1
    hidden, full = out.hidden_states[-1][0, :-1], out.logits[0, :-1]
    at = [t for t, lab in enumerate(labels.tolist()) if llama3_vocab.column_of(lab) is not None]
    gold = torch.tensor([llama3_vocab.column_of(labels[t]) for t in at])
    rows = torch.tensor(llama3_vocab.ids)
    z = hidden[at] @ model.lm_head.weight[rows].T  # [P, 1110]: never the full vocabulary
    torch.testing.assert_close(z, full[at][:, rows])
    got = char_logits(z, gold, llama3_vocab.char_table())
    assert got.logits.shape[0] == len("123456789314159") and torch.isfinite(got.logits).all()


# ----------------------------------------------------------------------------- targets and today's losses


def _labels(tokenizer, texts: list[str]) -> torch.Tensor:
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, rows))
    labels = torch.full((len(rows), width), -100)
    for b, row in enumerate(rows):
        labels[b, :len(row)] = torch.tensor(row)
    return labels


def _todays_terms_equal(tokenizer):
    """On a single-digit tokenizer, targets and DEL/NTL/DIST2 per character equal today's per-token ones."""
    from helpers import count_items, digit_targets, oracle_digits

    from delft.losses.heads import digit_logits
    from delft.losses.loss import Loss
    from delft.losses.terms import TERMS

    vocab = NumberVocab.from_tokenizer(tokenizer)
    labels = _labels(tokenizer, ["x 12.5 and 3.14159", "7 + 1,234 = 99", "no digits"])
    labels[0, 3] = -100  # an ignored label ends a run
    old = digit_targets(labels, oracle_digits(vocab))
    new = number_targets(labels, vocab)
    assert torch.equal(new.mask, old.mask) and torch.equal(new.gold, old.targets)
    assert torch.equal(new.weights, old.weights)
    assert count_digit_chars(labels, vocab) == count_items(labels, oracle_digits(vocab))[1] == len(new.gold)
    model = build_model(tokenizer, hidden=16, layers=1)
    hidden = model.model(labels.clamp(min=0)).last_hidden_state
    z = digit_logits(hidden[old.mask], model.lm_head, vocab.ids)
    chars = char_logits(z, new.gold, vocab.char_table())
    assert torch.equal(chars.logits, z) and torch.equal(chars.digit, old.targets)
    for kind in TERMS:
        term = Loss(kind, 1.0, vocab).term
        assert torch.equal(term(chars.logits, chars.digit, new.weights), term(z, old.targets, old.weights))


def test_single_digit_tokenizer_keeps_todays_targets_and_terms():
    _todays_terms_equal(build_tokenizer())


@pytest.mark.slow
def test_smollm2_tokenizer_keeps_todays_targets_and_terms():
    from transformers import AutoTokenizer

    from delft.models.sources import ensure_smollm2

    _todays_terms_equal(AutoTokenizer.from_pretrained(ensure_smollm2()))


def test_llama3_targets_weigh_every_digit_character(llama3_tokenizer, llama3_vocab):
    from delft.numbers.digits import place_weight

    labels = _labels(llama3_tokenizer, ["1234567.89", "x 45"])
    t = number_targets(labels, llama3_vocab)
    assert [llama3_vocab.texts[c] for c in t.gold.tolist()] == ["123", "456", "7", "89", "45"]
    places = [7, 6, 5, 4, 3, 2, 1, -1, -2, 2, 1]
    assert t.weights.tolist() == pytest.approx([place_weight(p) for p in places])
    assert count_digit_chars(labels, llama3_vocab) == len(places) == int(t.mask.sum()) + 6


def test_a_few_del_steps_on_the_llama3_vocabulary_lower_the_digit_term(llama3_tokenizer, llama3_vocab):
    """DEL per digit character, from the number-token rows only, trains a tiny random-init Llama-3 model."""
    from delft.losses.heads import digit_logits
    from delft.losses.terms import del_term

    model = build_model(llama3_tokenizer, hidden=16, layers=1)
    ids = _labels(llama3_tokenizer, ["pay 1234567.89 now", "pi is 3.14159"]).clamp(min=0)
    labels = ids[:, 1:]
    t = number_targets(labels, llama3_vocab)
    table = llama3_vocab.char_table()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def term():
        hidden = model.model(ids[:, :-1]).last_hidden_state
        chars = char_logits(digit_logits(hidden[t.mask], model.lm_head, llama3_vocab.ids), t.gold, table)
        return del_term(chars.logits, chars.digit, t.weights).sum() / len(t.weights)

    first = term()
    for _ in range(10):
        opt.zero_grad()
        loss = term()
        loss.backward()
        opt.step()
    last = term().item()
    assert last < 0.8 * first.item(), (first.item(), last)


def test_gradients_equal_for_8x1_4x2_2x4_micro_batches(llama3_tokenizer, llama3_vocab):
    """Per-micro-batch term sums over the batch-global N_digits (digit characters) give one gradient."""
    from delft.losses.heads import digit_logits
    from delft.losses.terms import del_term

    model = build_model(llama3_tokenizer, hidden=16, layers=1)
    texts = ["1234567.89", "x 45", "none", "3.14159", "12 + 7", "0.5", "99999", "a 1.2.3"]
    ids = _labels(llama3_tokenizer, texts).clamp(min=0)
    labels = ids[:, 1:].clone()
    labels[ids[:, 1:] == 0] = -100
    n_digits = count_digit_chars(labels, llama3_vocab)
    table = llama3_vocab.char_table()
    grads = []
    for size in (1, 2, 4):
        model.zero_grad()
        for s in range(0, len(texts), size):
            t = number_targets(labels[s:s + size], llama3_vocab)
            hidden = model.model(ids[s:s + size, :-1]).last_hidden_state
            chars = char_logits(digit_logits(hidden[t.mask], model.lm_head, llama3_vocab.ids), t.gold, table)
            (del_term(chars.logits, chars.digit, t.weights).sum() / n_digits).backward()
        grads.append(model.lm_head.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-4, atol=1e-7)
