"""The shift-invariant DEL forms, the reference's normalisation (against HF Trainer's arithmetic), place-weight
modes and the digit statistics in the log."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import digit_targets, oracle_digits, recipe_file
from tiny import build_model, build_tokenizer
from torch import nn

from delft.losses.loss import Counts, Loss, Sums
from delft.losses.modules import term_mean
from delft.losses.terms import TERMS
from delft.numbers.digits import place_weight
from delft.numbers.tokens import NumberVocab
from delft.recipe.schema import LossConfig
from delft.recipe.files import load_recipe

VARIANTS = ["del_prob", "del_centered"]


@pytest.fixture(scope="module")
def digits():
    """(tokenizer, NumberVocab), with torch on one thread: these tensors are tiny and the CPU is busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    yield tok, NumberVocab.from_tokenizer(tok)
    torch.set_num_threads(before)


def logits_with(p_y: float, offset: float, spread: float = 0.0) -> torch.Tensor:
    """[1, 10] fp64 logits: digit 0 (the target) has P(0 | digits) = p_y, the rest near ``offset``."""
    rest = torch.linspace(-spread, spread, 9, dtype=torch.float64)
    z_y = math.log(p_y / (1 - p_y)) + torch.logsumexp(rest, 0).item()
    return torch.cat([torch.tensor([z_y], dtype=torch.float64), rest]).view(1, 10) + offset


def grad_on_target(kind: str, z: torch.Tensor) -> torch.Tensor:
    """dL/dz of one position with target 0 and place weight 1, summed over the ten candidates (10 x the mean)."""
    z = z.clone().requires_grad_()
    (10 * TERMS[kind](z, torch.tensor([0]), torch.tensor([1.0])).sum()).backward()
    return z.grad[0]


# ------------------------------------------------------------------ shift invariance and the sign of dL/dz_y


@pytest.mark.parametrize("kind", VARIANTS)
def test_variants_do_not_move_when_all_digit_logits_move(kind):
    torch.manual_seed(0)
    z, y, w = torch.randn(6, 10, dtype=torch.float64) * 3, torch.randint(10, (6,)), torch.rand(6) + 0.5
    for shift in (-30.0, -3.0, 28.0):
        torch.testing.assert_close(TERMS[kind](z + shift, y, w), TERMS[kind](z, y, w), rtol=1e-9, atol=1e-12)
    assert grad_on_target(kind, z[:1]).sum().abs() < 1e-12  # no gradient along (1, ..., 1)


def test_reference_del_is_not_shift_invariant():
    z, y, w = torch.zeros(1, 10), torch.tensor([3]), torch.tensor([1.0])
    # at raw logits near +28 (where an LM's digit logits sit) the wrong digits' softplus(z_k) dominates:
    # moving every logit down to 0 lowers DEL thirtyfold with the same distribution
    assert TERMS["del"](z + 28, y, w).item() > 30 * TERMS["del"](z, y, w).item()


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("p_y", [0.02, 0.12, 0.5, 0.95])
@pytest.mark.parametrize("offset", [-30.0, -3.0, 0.0, 28.0])
def test_variants_always_raise_the_correct_digit(kind, p_y, offset):
    for spread in (0.0, 2.0):
        g = grad_on_target(kind, logits_with(p_y, offset, spread))
        assert g[0] < 0, (kind, p_y, offset, spread, g[0].item())  # descent moves z_y up


def test_reference_del_pushes_the_correct_digit_down_at_negative_logits():
    # ten logits near -3, P(correct | digits) = 0.12: dDEL/dz_y is positive, about +0.18 (docs/losses.md)
    g = grad_on_target("del", logits_with(0.12, -3.0))
    assert g[0].item() == pytest.approx(0.183, abs=0.002)
    # the same distribution at logits near +28 (where an LM's raw digit logits start): there it pulls up
    assert grad_on_target("del", logits_with(0.12, 28.0))[0] < 0
    # the naive shift-invariant form, BCE on p with p NOT detached, pushes down too at p_y = 0.12
    z = logits_with(0.12, 0.0).requires_grad_()
    p = torch.softmax(z, -1)
    hit = F.one_hot(torch.tensor([0]), 10).bool()
    (p * -torch.where(hit, p.log(), (1 - p).log())).sum().backward()
    assert z.grad[0, 0] > 0.05


def closed_form_grad(kind: str, z: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dL/dz from the docstrings' derivation, with the weight c_k = w sg(p_k) / 10 held constant."""
    p = torch.softmax(z, -1)
    c = w[:, None] * p / 10
    hit = F.one_hot(y, 10).to(z.dtype)
    eye = torch.eye(10, dtype=z.dtype)
    if kind == "del_centered":  # sum_k c_k (s(u_k) - 1[k = y]) (1[k = j] - 1/10)
        g = c * (torch.sigmoid(z - z.mean(-1, keepdim=True)) - hit)
        return g - g.sum(-1, keepdim=True) / 10
    # del_prob: d(-log p_y)/dz_j = p_j - 1[j = y]; d(-log(1 - p_k))/dz_j = p_k (1[j = k] - p_j) / (1 - p_k)
    d_miss = p[:, :, None] * (eye[None] - p[:, None, :]) / (1 - p)[:, :, None]  # [N, k, j]
    d_hit = (p - hit)[:, None, :].expand_as(d_miss)
    dl = torch.where(hit[:, :, None].bool(), d_hit, d_miss)
    return (c[:, :, None] * dl).sum(1)


@pytest.mark.parametrize("kind", VARIANTS)
def test_variant_gradients_equal_their_closed_form(kind):
    # torch.autograd.gradcheck does not apply as such: finite differences also move the detached weight
    # sg(p). So the autograd gradient is checked against the derivation, in float64, at random points.
    torch.manual_seed(1)
    for scale, offset in ((1.0, 0.0), (4.0, -30.0), (4.0, 28.0)):
        z = (torch.randn(7, 10, dtype=torch.float64) * scale + offset).requires_grad_()
        y, w = torch.randint(10, (7,)), torch.rand(7, dtype=torch.float64) * 4
        TERMS[kind](z, y, w).sum().backward()
        torch.testing.assert_close(z.grad, closed_form_grad(kind, z.detach(), y, w), rtol=1e-9, atol=1e-12)
        assert (z.grad.gather(1, y[:, None]) < 0).all()


# ------------------------------------------------------------------ hand-worked values


def test_variants_by_hand_at_equal_logits():
    # all ten logits equal: p_k = 0.1. del_prob: BCE(0.1, 1) = ln 10, BCE(0.1, 0) = ln(10/9)
    z, y, w = torch.full((1, 10), 7.0, dtype=torch.float64), torch.tensor([4]), torch.tensor([2.0])
    want = 2.0 * 0.1 * (math.log(10) + 9 * math.log(10 / 9)) / 10
    assert TERMS["del_prob"](z, y, w).item() == pytest.approx(want, rel=1e-12)
    # del_centered: centred logits are 0, every BCE is ln 2
    assert TERMS["del_centered"](z, y, w).item() == pytest.approx(2.0 * 0.1 * math.log(2), rel=1e-12)
    # gradients on the target (docstrings): -w/100 and -0.009 w per mean over candidates
    zg = z.clone().requires_grad_()
    TERMS["del_prob"](zg, y, w).sum().backward()
    assert zg.grad[0, 4].item() == pytest.approx(-0.02, rel=1e-9)
    zg = z.clone().requires_grad_()
    TERMS["del_centered"](zg, y, w).sum().backward()
    assert zg.grad[0, 4].item() == pytest.approx(-0.018, rel=1e-9)


def test_del_prob_by_hand_uneven():
    z = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0, 0, -1.0]], dtype=torch.float64)
    s = math.e + 8 + math.exp(-1)
    p = [math.e / s] + [1 / s] * 8 + [math.exp(-1) / s]
    # target 9: the least likely digit
    want = (p[9] * -math.log(p[9]) + sum(p[k] * -math.log(1 - p[k]) for k in range(9))) / 10
    assert TERMS["del_prob"](z, torch.tensor([9]), torch.tensor([1.0])).item() == pytest.approx(want, rel=1e-12)


def test_del_prob_is_finite_when_a_digit_is_certain():
    z = torch.zeros(2, 10, requires_grad=True)
    z0 = z + torch.tensor([60.0] + [0.0] * 9)
    out = TERMS["del_prob"](z0, torch.tensor([0, 3]), torch.ones(2))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(z.grad).all() and out[0] < 1e-6


# ------------------------------------------------------------------ place weights


def test_place_weight_modes_by_hand():
    assert [place_weight(r) for r in (1, 5, 20)] == [2.0, 10.0, 40.0]
    assert [place_weight(r, "capped") for r in (1, 4, 5, 6, 20)] == [2.0, 8.0, 10.0, 10.0, 10.0]
    assert [place_weight(r, "capped", cap=3.0) for r in (1, 2, 9)] == [2.0, 3.0, 3.0]
    assert [place_weight(r, "uniform") for r in (1, 20, -1, -7)] == [1.0] * 4
    for mode in ("reference", "capped"):  # fraction digits are below 1 and untouched by the cap
        assert place_weight(-2, mode) == pytest.approx(1.02 ** -3)
    with pytest.raises(ValueError):
        place_weight(1, "log")


def test_place_weight_modes_reach_the_loss(digits):
    tok, vocab = digits
    labels = torch.tensor([tok.encode("123456789012.5", add_special_tokens=False)])
    for mode, cap, want in [("reference", 10.0, [24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2]),
                            ("capped", 10.0, [10] * 8 + [8, 6, 4, 2]),
                            ("capped", 5.0, [5] * 10 + [4, 2]), ("uniform", 10.0, [1] * 12)]:
        loss = Loss("del", 1.0, vocab, place_weights=mode, place_weight_cap=cap)
        w = digit_targets(labels, oracle_digits(vocab), loss.weigh).weights.tolist()
        tail = 1.0 if mode == "uniform" else 1.02 ** -2
        assert w == pytest.approx([float(x) for x in want] + [tail])
        # and the term scales with them: a uniform-weight DEL at zero logits is the unweighted mean
        if mode == "uniform":
            z = torch.zeros(*labels.shape, 10)
            assert term_mean(z, labels, loss).item() == pytest.approx(0.1 * math.log(2), rel=1e-6)


def test_place_weight_options_in_the_recipe():
    assert LossConfig(type="del_prob", place_weights="capped", place_weight_cap=6).place_weight_cap == 6
    with pytest.raises(ValueError, match="only apply to the DEL types"):
        LossConfig(type="ntl_was", place_weights="uniform")
    with pytest.raises(ValueError, match="capped"):
        LossConfig(type="del", place_weight_cap=4)


# ------------------------------------------------------------------ reference normalisation vs HF Trainer


def simulate_hf_trainer(lm_head, shards, vocab, lam: float) -> list[torch.Tensor]:
    """The DEL reference under transformers' Trainer (compute_loss_func, average_tokens_across_devices=True):
    per device, per micro-batch: loss = CE_sum / num_items_in_batch (all devices, all micro-batches) +
    lambda x DEL mean of the micro-batch; loss *= num_processes; not divided by the accumulation steps
    (the loss counts as scaled for accumulation); gradients add over micro-batches, then DDP averages devices."""
    world = len(shards)
    num_items = sum(int((lab != -100).sum()) for shard in shards for _, lab in shard)
    del_mean = Loss("del", 1.0, vocab)
    grads = []
    for shard in shards:
        lm_head.zero_grad()
        for hidden, labels in shard:
            logits = lm_head(hidden)
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            loss = ce / num_items + lam * term_mean(logits, labels, del_mean)
            (loss * world).backward()
        grads.append(lm_head.weight.grad.clone())
    return [sum(grads) / world]


def test_reference_normalisation_equals_hf_trainer(digits):
    tok, vocab = digits
    torch.manual_seed(5)
    texts = ["a 12+7=19 b", "x 3.5 y 400", "no digits!!", "n=100000007", "8 * 9 = 72.", "-0.125 is 1",
             "it is 2026.", "5 5 5 5 5 5"]
    assert len({len(tok.encode(t, add_special_tokens=False)) for t in texts}) == 1  # same labels per device
    H, lam, ga = 16, 0.01, 4
    lm_head = nn.Linear(H, len(tok), bias=False)

    def micro(text):  # one sequence per micro-batch, as in the reference's scripts
        labels = torch.tensor([tok.encode(text, add_special_tokens=False)])
        return torch.randn(*labels.shape, H), labels

    batches = [micro(t) for t in texts]
    for world in (1, 2):
        shards = [batches[d * ga:(d + 1) * ga] for d in range(world)]
        ref = simulate_hf_trainer(lm_head, shards, vocab, lam)[0]
        loss = Loss("del", lam, vocab, normalisation="reference", grad_accum=ga, world_size=world)
        # delft's data-parallel step: counts over every rank first, each rank backward on its share, then the
        # ranks' gradients and Sums are summed (delft.training.distributed.all_reduce_grads / global_sums)
        counts = sum((loss.count(lab) for shard in shards for _, lab in shard), Counts(0, 0))
        device_grads, total = [], Sums(0.0, 0.0, Counts(0, 0))
        for shard in shards:
            lm_head.zero_grad()
            for hidden, labels in shard:
                s = loss.sums(hidden, lm_head, labels)
                loss.combine(s, counts).backward()
                total = total + s.detach()
            device_grads.append(lm_head.weight.grad.clone())
        torch.testing.assert_close(sum(device_grads), ref, rtol=1e-5, atol=1e-7)
        m = loss.means(total, counts)
        # the step's reported loss: CE per label + lambda x GA x world x mean of all micro-batch means
        per_micro = [term_mean(lm_head(h), lab, Loss("del", 1.0, vocab)).item() for sh in shards for h, lab in sh]
        assert m["term"] == pytest.approx(sum(per_micro) / (ga * world), rel=1e-5)
        assert m["loss"] == pytest.approx(m["ce"] + lam * ga * world * m["term"], rel=1e-6)
        # and the reported loss is the one whose gradient this is: d(loss)/dW by autograd on all micro-batches
        lm_head.zero_grad()
        ce_all = sum(F.cross_entropy(lm_head(h).flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
                     for sh in shards for h, lab in sh) / counts.labels
        mean_all = sum(term_mean(lm_head(h), lab, Loss("del", 1.0, vocab)) for sh in shards for h, lab in sh)
        (ce_all + lam * ga * world * mean_all / (ga * world)).backward()
        torch.testing.assert_close(lm_head.weight.grad, ref, rtol=1e-5, atol=1e-7)
    # delft's default is not that: each digit counts once, whatever the micro-batch
    glob = Loss("del", lam, vocab)
    lm_head.zero_grad()
    counts = sum((glob.count(lab) for _, lab in batches[:ga]), Counts(0, 0))
    for hidden, labels in batches[:ga]:
        glob.combine(glob.sums(hidden, lm_head, labels), counts).backward()
    assert not torch.allclose(lm_head.weight.grad, simulate_hf_trainer(lm_head, [batches[:ga]], vocab, lam)[0])


def test_sums_travel_whole_through_the_all_reduce_list():
    """distributed.global_sums sums ``as_floats``: every field must be in it and come back."""
    import dataclasses

    s = Sums(1.5, 2.5, Counts(7, 3), 0.25, 2, -4.0, 1.75)
    values = s.as_floats()
    assert Sums.from_floats(values) == s
    assert len(values) == len(dataclasses.fields(Sums)) + 1  # counts are two numbers
    assert Sums.from_floats([a + b for a, b in zip(values, values)]) == s + s


def test_reference_normalisation_from_the_recipe(digits, tmp_path, tiny_model_dir):
    vocab = digits[1]
    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"grad_accum": 32},
                                     loss={"type": "del", "weight": 0.01, "normalisation": "reference"}))
    loss = Loss.from_recipe(recipe, vocab, "cpu")
    assert (loss.normalisation, loss.grad_accum, loss.world_size) == ("reference", 32, 1)
    assert loss.term_scale == pytest.approx(0.32 / 0.01)
    assert Loss.from_recipe(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="g")), vocab, "cpu").term_scale == 1


# ------------------------------------------------------------------ digit statistics in the log


def test_logged_digit_statistics_equal_a_direct_computation(digits):
    tok, vocab = digits
    from delft.training.step import optimizer_step

    model = build_model(tok, hidden=32, layers=2)
    texts = ["Q: 12+7=19!", "Q: ab cd ef", "Q: x=3.25 !", "Q: 100000 7"]
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    input_ids = torch.tensor(rows)
    labels = input_ids.clone()
    labels[:, :3] = -100
    batches = [{"input_ids": input_ids[i:i + 2], "labels": labels[i:i + 2],
                "attention_mask": torch.ones_like(input_ids[i:i + 2])} for i in (0, 2)]
    out = optimizer_step(model, batches, Loss("del_prob", 0.3, vocab), "cpu")
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, :-1]
    shifted = labels[:, 1:]
    ids = torch.tensor(vocab.digit_ids)
    mask = torch.isin(shifted, ids)
    z = logits[mask][:, ids]
    y = (shifted[mask][:, None] == ids).float().argmax(-1)
    assert out["n_digits"] == int(mask.sum()) > 5
    assert out["digit_logit"] == pytest.approx(z.mean().item(), rel=1e-5)
    assert out["p_digit"] == pytest.approx(torch.softmax(z, -1).gather(-1, y[:, None]).mean().item(), rel=1e-5)


@pytest.mark.parametrize("kind", VARIANTS)
def test_variants_train_and_log_digit_statistics(tmp_path, tiny_model_dir, kind):
    from delft.training.stages import run_training

    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, loss={"type": kind},
                                               train={"max_steps": 2, "logging_steps": 1})))
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(rows) == 2 and all(r["term"] > 0 and math.isfinite(r["digit_logit"]) for r in rows)
    assert all(0 < r["p_digit"] < 1 for r in rows)
