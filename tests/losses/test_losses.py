"""Digit losses: hand-worked values, place weights, gradients, chunked == full, accumulation invariance."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import count_items, digit_targets, oracle_digits
from tiny import build_model, build_tokenizer
from torch import nn

from delft.errors import UserError
from delft.losses.heads import resolve_fused
from delft.losses.loss import Loss
from delft.losses.modules import DigitEntropyLoss, Dist2Loss, NumberTokenLoss, full_logits_loss, term_mean
from delft.losses.registry import LOSS_TYPES
from delft.losses.terms import del_term
from delft.numbers.tokens import NumberVocab
from delft.recipe.schema import LossConfig

LN2 = math.log(2)
TYPES = [name for name, t in LOSS_TYPES.items() if t.has_term]  # every registered digit term


def frac(i: int) -> float:
    return 1.02 ** -(i + 1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: on a busy 2-core machine OpenMP wake-ups cost ~10 ms per op, so run serially."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return NumberVocab.from_tokenizer(tok)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def labels_of(tok, *texts: str) -> torch.Tensor:
    rows = [ids(tok, t) for t in texts]
    assert len({len(r) for r in rows}) == 1
    return torch.tensor(rows)


def make_loss(kind: str, vocab, tau: float = 1.0):
    """The public module of ``kind``; types without one (the DEL variants) as a term mean through Loss."""
    modules = {"del": lambda: DigitEntropyLoss(vocab=vocab), "ntl_was": lambda: NumberTokenLoss(kind="was", vocab=vocab),
               "ntl_mse": lambda: NumberTokenLoss(kind="mse", vocab=vocab),
               "dist2": lambda: Dist2Loss(tau=tau, vocab=vocab)}
    if kind in modules:
        return modules[kind]()
    loss = Loss(kind, 1.0, vocab)
    return lambda logits, labels: term_mean(logits, labels, loss)


# ------------------------------------------------------------------ hand-computed values


def test_del_two_digit_by_hand(tok, vocab):
    labels = labels_of(tok, "42")
    z = torch.zeros(1, 2, 10)
    z[0, 0, 4] = 2.0                      # '4': right digit favoured
    z[0, 1, 2], z[0, 1, 7] = 1.0, -1.0    # '2'
    # position 0: y=4, tens -> w = 2*2 = 4
    s0 = math.exp(2) + 9
    t0 = 4 * (math.exp(2) / s0 * math.log(1 + math.exp(-2)) + 9 / s0 * LN2) / 10
    # position 1: y=2, units -> w = 2; BCE(1, 1) = BCE(-1, 0) = log(1 + e^-1)
    s1 = math.e + math.exp(-1) + 8
    t1 = 2 * (math.e / s1 * math.log(1 + math.exp(-1)) + math.exp(-1) / s1 * math.log(1 + math.exp(-1))
              + 8 / s1 * LN2) / 10
    got = DigitEntropyLoss(tok)(z, labels)
    assert got.item() == pytest.approx((t0 + t1) / 2, rel=1e-6)


def test_del_decimal_by_hand_full_vocab(tok, vocab):
    labels = labels_of(tok, "1.5")
    logits = torch.zeros(1, 3, len(tok))
    logits[0, 1] = torch.randn(len(tok)) * 3          # the '.' position is never scored
    logits[0, 0, ids(tok, "a")[0]] = 5.0               # non-digit mass is outside DEL's softmax
    logits[0, 0, vocab.digit_ids[1]] = 1.0
    logits[0, 2, vocab.digit_ids[3]] = 2.0
    # '1': units, w = 2; p1 = e/(e+9)
    s0 = math.e + 9
    t0 = 2 * (math.e / s0 * math.log(1 + math.exp(-1)) + 9 / s0 * LN2) / 10
    # '5': first fraction digit, w = 1.02^-2; wrong '3' has z=2 -> BCE(2, 0) = log(1 + e^2); the label z=0 -> log 2
    s2 = math.exp(2) + 9
    t2 = 1.02 ** -2 * (math.exp(2) / s2 * math.log(1 + math.exp(2)) + 9 / s2 * LN2) / 10
    got = DigitEntropyLoss(tok)(logits, labels)
    assert got.item() == pytest.approx((t0 + t2) / 2, rel=1e-6)


def test_ntl_and_dist2_one_position_by_hand(tok, vocab):
    labels = labels_of(tok, "5")
    z = torch.zeros(1, 1, 10)
    z[0, 0, 3] = 1.0
    s = math.e + 9
    p = [(math.e if k == 3 else 1.0) / s for k in range(10)]
    was = (2 * math.e + 23) / s           # sum_k |k-5| = 25, minus the 2 at k=3, plus e*2
    mse = ((3 * math.e + 42) / s - 5) ** 2
    tau = 0.7
    zq = sum(math.exp(-((k - 5) ** 2) / tau) for k in range(10))
    q = [math.exp(-((k - 5) ** 2) / tau) / zq for k in range(10)]
    kl = sum(q[k] * (math.log(q[k]) - math.log(p[k])) for k in range(10))
    assert NumberTokenLoss(tok, "was")(z, labels).item() == pytest.approx(was, rel=1e-6)
    assert NumberTokenLoss(tok, "mse")(z, labels).item() == pytest.approx(mse, rel=1e-6)
    assert Dist2Loss(tok, tau=tau)(z, labels).item() == pytest.approx(kl, rel=1e-5)
    # tau = 1, y = 5: the target is ~0.56 on 5 and ~0.21 on 4 and 6 (docs/losses.md); predicting it exactly costs 0
    q1 = torch.tensor([math.exp(-((k - 5) ** 2)) for k in range(10)])
    q1 = q1 / q1.sum()
    assert q1[5].item() == pytest.approx(0.56, abs=0.01) and q1[4].item() == pytest.approx(0.21, abs=0.01)
    assert Dist2Loss(tok)(q1.log().view(1, 1, 10), labels).item() == pytest.approx(0, abs=1e-6)
    assert Dist2Loss(tok)(torch.zeros(1, 1, 10), labels).item() > 1.0


# ------------------------------------------------------------------ place weights, recovered from the loss


def weights_via_loss(labels: torch.Tensor, vocab) -> list[list[float]]:
    """At zero logits ||dDEL/dz_t|| = w_t * g / N with g the same for every label (symmetry): solve for w_t."""
    z = torch.zeros(*labels.shape, 10, requires_grad=True)
    DigitEntropyLoss(vocab=vocab)(z, labels).backward()
    n = count_items(labels, vocab)[1]
    z1 = torch.zeros(1, 10, requires_grad=True)
    del_term(z1, torch.tensor([0]), torch.tensor([1.0])).sum().backward()
    return (z.grad.norm(dim=-1) * n / z1.grad.norm()).tolist()


@pytest.mark.parametrize("text,expected", [
    ("345", [6, 4, 2]),
    ("12.57", [4, 2, 0, frac(1), frac(2)]),
    ("1.2.3", [2, 0, frac(1), 0, frac(3)]),
    (".5", [0, 2]),
    ("is 7.", [0, 0, 0, 2, 0]),
    ("-42", [0, 4, 2]),
])
def test_place_weights(tok, vocab, text, expected):
    assert weights_via_loss(labels_of(tok, text), vocab)[0] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_ignored_label_splits_run_and_sequences_do_not_merge(tok, vocab):
    labels = labels_of(tok, "12345")
    labels[0, 2] = -100
    assert weights_via_loss(labels, vocab)[0] == pytest.approx([4, 2, 0, 4, 2], rel=1e-5, abs=1e-6)
    # flattened, "12" + "34" would be one run 8, 6, 4, 2
    assert sum(weights_via_loss(labels_of(tok, "12", "34"), vocab), []) == pytest.approx([4, 2, 4, 2], rel=1e-5)
    dt = digit_targets(labels_of(tok, "x12.57"), oracle_digits(vocab))
    assert dt.mask.tolist() == [[False, True, True, False, True, True]]
    assert dt.targets.tolist() == [1, 2, 5, 7]


# ------------------------------------------------------------------ gradcheck (float64)

SMALL = NumberVocab.single_digits(tuple(range(3, 13)), 13)   # V = 16: digits 3..12, '.' 13
SMALL_LABELS = torch.tensor([[0, 3 + 4, 3 + 2, 13, 3 + 7, -100], [3 + 9, 1, -100, 3 + 0, 13, 2]])


# the DEL variants detach their weight sg(p), which finite differences cannot hold still: their gradients are
# checked against the closed form in test_loss_variants.py
@pytest.mark.parametrize("kind", [k for k in TYPES if k not in ("del_prob", "del_centered")])
@pytest.mark.parametrize("width", [10, 16])
def test_gradcheck(kind, width):
    torch.manual_seed(0)
    fn = make_loss(kind, SMALL, tau=0.7)
    logits = torch.randn(2, 6, width, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: fn(x, SMALL_LABELS), (logits,), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------ chunked == full logits


class Wrapped(nn.Module):
    """Not an nn.Linear: forces the forward() path (what a peft/bnb head looks like to us)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("kind", TYPES + ["ce"])
@pytest.mark.parametrize("head", ["model", "bias", "wrapped"])
def test_chunked_equals_full(tok, vocab, kind, head):
    torch.manual_seed(1)
    V, H = len(tok), 16
    lm_head = nn.Linear(H, V, bias=(head == "bias"))
    module = Wrapped(lm_head) if head == "wrapped" else lm_head
    labels = labels_of(tok, "a 12.5 = 7x", "no digits!!", "-308 or 44.")
    labels[1, :3] = -100
    loss = Loss(kind, 0.7, vocab if kind != "ce" else None, chunk_size=4, **({"tau": 0.5} if kind == "dist2" else {}))
    hidden = torch.randn(*labels.shape, H, requires_grad=True)

    full = full_logits_loss(module(hidden), labels, loss)["loss"]
    g_full = torch.autograd.grad(full, [hidden, lm_head.weight])

    counts = loss.count(labels)
    s = loss.sums(hidden, module, labels)
    assert s.counts == counts == count_items(labels, loss.vocab) and s.counts.labels > 4
    chunked = loss.combine(s, counts)
    g_chunk = torch.autograd.grad(chunked, [hidden, lm_head.weight])

    assert chunked.item() == pytest.approx(full.item(), rel=1e-5)
    for a, b in zip(g_chunk, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ accumulation invariance on a tiny model


def test_gradient_independent_of_micro_batching(tok, vocab):
    texts = ["ab 12+7=19", "no numbers", "x=3.25 ok!", "9", "1.2.3 and 4", "", "-42. end", "100000007"]
    T = 12
    rows = [ids(tok, "Q:" + t)[:T] for t in texts]
    input_ids = torch.full((8, T), tok.pad_token_id)
    labels = torch.full((8, T), -100)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r)
        labels[i, 2:len(r)] = torch.tensor(r[2:])   # prompt "Q:" not trained
    model = build_model(tok, hidden=32, layers=2)
    loss = Loss("del", 1.0, vocab, chunk_size=7)
    shifted = labels[:, 1:]
    counts = loss.count(shifted)
    digits_per_row = [loss.count(shifted[i:i + 1]).digits for i in range(8)]
    assert len(set(digits_per_row)) > 3 and counts.digits > 0

    def grads(micro: int):
        model.zero_grad()
        for s in range(0, 8, micro):
            hidden = model.model(input_ids=input_ids[s:s + micro]).last_hidden_state[:, :-1]
            loss.combine(loss.sums(hidden, model.lm_head, shifted[s:s + micro]), counts).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads(8)
    assert any(g.abs().sum() > 0 for g in ref)
    for micro in (4, 2, 1):
        for a, b in zip(grads(micro), ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the whole batch through HF's full logits gives the same gradient
    model.zero_grad()
    full_logits_loss(model(input_ids=input_ids).logits[:, :-1], shifted, loss)["loss"].backward()
    for p, b in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ ntloss as an oracle


def test_agrees_with_ntloss():
    from ntloss import NTLoss, NTLossDotProduct

    tok2 = build_tokenizer()   # ntloss calls add_tokens (a no-op here): keep it off the shared fixture
    V = len(tok2)
    vocab2 = NumberVocab.from_tokenizer(tok2)
    torch.manual_seed(2)
    logits = torch.randn(3, 9, V) * 2
    pool = torch.tensor(list(vocab2.digit_ids) + ids(tok2, "ab.x -") + [-100])
    labels = pool[torch.randint(len(pool), (3, 9))]
    assert count_items(labels, vocab2)[1] > 3
    was = NTLoss(tok2, vocab_size=V, reweigh=False)(logits, labels)
    mse = NTLossDotProduct(tok2, vocab_size=V, reweigh=False)(logits, labels)
    assert len(tok2) == V
    torch.testing.assert_close(NumberTokenLoss(vocab=vocab2, kind="was")(logits, labels), was, rtol=1e-5, atol=0)
    torch.testing.assert_close(NumberTokenLoss(vocab=vocab2, kind="mse")(logits, labels), mse, rtol=1e-5, atol=0)


# ------------------------------------------------------------------ dtypes, empty batches, errors


def test_bf16_logits_give_fp32(tok, vocab):
    torch.manual_seed(3)
    labels = labels_of(tok, "x 3.14159", "y 271828!")
    logits = (torch.randn(*labels.shape, len(tok)) * 4).bfloat16().requires_grad_()
    for kind in TYPES:
        out = make_loss(kind, vocab)(logits, labels)
        assert out.dtype == torch.float32 and torch.isfinite(out) and out.item() > 0
        out.backward()
        assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()
    lm_head = nn.Linear(8, len(tok)).bfloat16()
    s = Loss("del", 0.3, vocab, chunk_size=5).sums(torch.randn(*labels.shape, 8).bfloat16(), lm_head, labels)
    assert s.ce.dtype == s.term.dtype == torch.float32 and torch.isfinite(s.term)


def test_no_digit_labels_is_zero_with_grad(tok, vocab):
    labels = labels_of(tok, "abc.", "x-y!")
    labels[0, 0] = -100
    for kind in TYPES:
        logits = torch.randn(*labels.shape, len(tok), requires_grad=True)
        out = make_loss(kind, vocab)(logits, labels)
        assert out.item() == 0.0
        out.backward()
        assert logits.grad is not None and not logits.grad.any()
    hidden = torch.randn(*labels.shape, 8, requires_grad=True)
    loss = Loss("del", 0.3, vocab, chunk_size=3)
    s = loss.sums(hidden, nn.Linear(8, len(tok)), labels)
    assert s.counts.digits == 0 and s.term.item() == 0.0
    loss.combine(s, s.counts).backward()
    assert torch.isfinite(hidden.grad).all()
    labels[:] = -100   # nothing labelled at all: still a finite 0 in the graph
    s = loss.sums(hidden, nn.Linear(8, len(tok)), labels)
    assert s.ce.item() == 0.0 and s.counts.labels == 0
    out = loss.combine(s, s.counts)
    assert out.item() == 0.0
    out.backward()


def test_standalone_losses_take_number_token_tokenizers_and_refuse_glued_digits():
    from delft.numbers.tokens import NumberVocab

    tok = build_tokenizer(chunked_digits=True)  # number tokens of several digits, as Llama-3 writes them
    labels = labels_of(tok, "x 123 + 45.6 = 168.6")
    logits = torch.randn(*labels.shape, len(tok), generator=torch.Generator().manual_seed(0))
    numbers = NumberVocab.from_tokenizer(tok)
    assert not numbers.is_single_digit
    for module, kind, params in ((DigitEntropyLoss(tok), "del", {}), (NumberTokenLoss(tok, "was"), "ntl_was", {}),
                                 (Dist2Loss(tok, tau=0.5), "dist2", {"tau": 0.5})):
        want = term_mean(logits, labels, Loss(kind, 1.0, numbers, **params))
        assert want.item() > 0
        torch.testing.assert_close(module(logits, labels), want, rtol=0, atol=0)
    with pytest.raises(UserError, match="glue|glued"):
        DigitEntropyLoss(build_tokenizer(glued_digits=True))


def test_misaligned_logits_are_refused(tok, vocab):
    with pytest.raises(ValueError, match="shift"):
        DigitEntropyLoss(vocab=vocab)(torch.zeros(1, 4, len(tok)), labels_of(tok, "123"))


def test_loss_from_config_and_fused_resolution(vocab):
    loss = Loss.from_config(LossConfig(type="dist2", tau=0.5), vocab)
    assert (loss.type, loss.weight, loss.params) == ("dist2", 0.1, {"tau": 0.5})
    assert Loss.from_config(LossConfig(type="del"), vocab).weight == 0.03
    assert not Loss.from_config(LossConfig(type="ce"), None).has_term
    with pytest.raises(UserError, match="single-token digits"):
        Loss.from_config(LossConfig(type="del"), None)
    assert resolve_fused("off", "cpu") is False and resolve_fused("auto", "cpu") is False


def test_fused_on_without_cuda_or_interpreter_is_a_user_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="fused_loss.*no CUDA"):
        resolve_fused("on", "cpu")


def test_combine_is_ce_per_label_plus_lambda_term_per_digit(vocab):
    from delft.losses.loss import Counts, Sums

    loss = Loss("del", 0.5, vocab)
    assert loss.combine(Sums(6.0, 2.0, Counts(1, 1)), Counts(3, 4)) == pytest.approx(6 / 3 + 0.5 * 2 / 4)
    assert loss.means(Sums(6.0, 0.0, Counts(3, 0)), Counts(3, 0)) == {"ce": 2.0, "term": 0.0, "loss": 2.0,
                                                                      "digit_logit": None, "p_digit": None}
    assert Loss("ce").combine(Sums(6.0, 0.0, Counts(3, 0)), Counts(3, 4)) == 2.0  # no term, whatever the digits


def test_every_loss_type_has_a_term_and_a_recipe_value():
    from delft.losses.registry import LOSS_TYPES
    from delft.losses.terms import TERMS

    assert set(TERMS) == {n for n, t in LOSS_TYPES.items() if t.has_term}
    for name in LOSS_TYPES:
        assert LossConfig(type=name).weight == LOSS_TYPES[name].default_weight
    with pytest.raises(ValueError, match="takes no tau"):
        Loss("del", 0.3, NumberVocab.single_digits(tuple(range(10)), 10), tau=0.5)
