"""The public core without delft's loop: DigitLoss (every registry type) and digit_term_sum (sum and count from
hidden states, never full logits), on single-digit and Llama-3-style number-token tokenizers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import digit_targets, oracle_digits
from tiny import build_tokenizer

from delft.losses import DigitLoss, digit_term_sum
from delft.losses.modules import term_mean
from delft.losses.registry import LOSS_TYPES
from delft.losses.terms import TERMS
from delft.numbers.tokens import NumberVocab

TEXTS = ["x 12.5 and 3.14159 y", "7 + 1,234 = 1241 ok", "no digits here at all"]


def labels_of(tok, texts):
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, rows))
    return torch.tensor([r + [-100] * (width - len(r)) for r in rows])


@pytest.mark.parametrize("kind", sorted(LOSS_TYPES))
def test_digit_loss_is_ce_plus_weight_times_the_oracle_term(kind):
    tok = build_tokenizer()
    labels = labels_of(tok, TEXTS)
    torch.manual_seed(0)
    logits = torch.randn(*labels.shape, len(tok), dtype=torch.float64, requires_grad=True)
    loss = DigitLoss(tok, kind)(logits, labels)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    want = ce
    if LOSS_TYPES[kind].replaces_ce:  # dft: each label's CE weighted by its detached probability (hand-computed)
        mask = labels.flatten() != -100
        logp = F.log_softmax(logits.flatten(0, 1)[mask], -1).gather(1, labels.flatten()[mask, None])[:, 0]
        want = -(logp * logp.exp().detach()).sum() / mask.sum()
    elif kind != "ce":
        oracle = oracle_digits(NumberVocab.from_tokenizer(tok))
        dt = digit_targets(labels, oracle)
        term = TERMS[kind](logits[dt.mask][:, list(oracle.digit_ids)], dt.targets, dt.weights).mean()
        want = ce + LOSS_TYPES[kind].default_weight * term
    assert float(loss) == pytest.approx(float(want), rel=1e-10)
    g, = torch.autograd.grad(loss, logits)
    g_want, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g, g_want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("tokenizer", ["single digits", "llama-3"])
def test_digit_term_sum_from_hidden_states_equals_the_full_logits_term(tokenizer, request):
    tok = build_tokenizer() if tokenizer == "single digits" else request.getfixturevalue("llama3_tokenizer")
    labels = labels_of(tok, TEXTS)
    vocab = NumberVocab.from_tokenizer(tok)
    torch.manual_seed(1)
    head = torch.nn.Linear(16, len(tok), bias=False).double()
    hidden = torch.randn(*labels.shape, 16, dtype=torch.float64)
    module = DigitLoss(tok, "del_prob")
    total, count = digit_term_sum(hidden, head, labels, module.loss)
    assert count == sum(c.isdigit() for t in TEXTS for c in t)  # every digit character; commas are not digits
    with torch.no_grad():
        mean = term_mean(head(hidden), labels, module.loss)
    assert float(total) == pytest.approx(float(mean) * count, rel=1e-10)
    assert vocab.max_len == (1 if tokenizer == "single digits" else 3)


def test_digit_loss_refuses_unknown_types_and_options():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="del_prop"):
        DigitLoss(tok, "del_prop")
    with pytest.raises(ValueError, match="tau"):
        DigitLoss(tok, "del", tau=0.5)  # tau is dist2's
