"""Digit-aware losses: DEL, NTL (WAS/MSE) and DIST2, plus a memory-lean CE for the trainer.

Formulas follow shared/docs/losses.md. Shapes: logits[:, t] scores labels[:, t] (the caller shifts, like
ntloss); -100 labels are ignored. All digit terms are computed in fp32 (fp64 inputs stay fp64), from the
ten digit logit columns only.

Normalisation used by delft (the trainer): over one optimizer batch,
    loss = CE_sum / N_labels + lambda * term_sum / N_digits
with N_labels / N_digits counted over the WHOLE optimizer batch (``count_items``) before the micro-batches
run, so the gradient does not depend on how the batch is split. ``loss_sums`` gives the per-micro-batch sums.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from delft.digits import DigitVocab, place_weight
from delft.errors import UserError
from delft.triton_cpu import interpreter_on, patch_interpreter

IGNORE = -100
TERM_TYPES = ("del", "ntl_was", "ntl_mse", "dist2")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, fp64 kept (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Targets from labels
# ---------------------------------------------------------------------------------------------------------


class DigitTargets(NamedTuple):
    mask: Tensor     # [B, T] bool: label is a digit; hidden[mask] / logits[mask] give the N rows, row-major
    targets: Tensor  # [N] long, digit value 0..9
    weights: Tensor  # [N] float32, DEL place weight


def digit_targets(labels: Tensor, vocab: DigitVocab) -> DigitTargets:
    """Digit positions, their values and DEL place weights; runs are found per sequence (digits.py)."""
    rows = labels.tolist()
    mask = [[False] * labels.shape[-1] for _ in rows]
    targets: list[int] = []
    weights: list[float] = []
    for b, row in enumerate(rows):
        for t, place in enumerate(vocab.places(row)):
            if place is None:
                continue
            mask[b][t] = True
            targets.append(int(vocab.char_of(row[t])))
            weights.append(place_weight(place))
    dev = labels.device
    return DigitTargets(torch.tensor(mask, dtype=torch.bool, device=dev).reshape(labels.shape),
                        torch.tensor(targets, dtype=torch.long, device=dev),
                        torch.tensor(weights, dtype=torch.float32, device=dev))


def count_items(labels: Tensor, vocab: Optional[DigitVocab]) -> tuple[int, int]:
    """(labelled positions, digit-labelled positions): the trainer's denominators for a whole optimizer batch.

    Every digit label gets a place in digits.py, so counting digit ids equals len(digit_targets(...).targets).
    """
    n_labels = int((labels != IGNORE).sum())
    if vocab is None:
        return n_labels, 0
    ids = torch.tensor(vocab.digit_ids, device=labels.device)
    return n_labels, int(torch.isin(labels, ids).sum())


# ---------------------------------------------------------------------------------------------------------
# Per-position terms on the ten digit logits: z [N, 10], y [N] (0..9), w [N] (place weight, DEL only) -> [N]
# ---------------------------------------------------------------------------------------------------------


def _prep(z: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = z.to(_compute_dtype(z.dtype))
    return z, y.to(device=z.device, dtype=torch.long)


def del_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """DEL: w * mean_k p_k * BCEWithLogits(z_k, 1[k == y]); p not detached (reference code)."""
    z, y = _prep(z, y)
    p = torch.softmax(z, dim=-1)
    b = F.binary_cross_entropy_with_logits(z, F.one_hot(y, 10).to(z.dtype), reduction="none")
    # mean over k here, so a mean over positions equals the mean over all N x 10 entries
    return w.to(z) * (p * b).mean(dim=-1)


def ntl_was_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None) -> Tensor:
    """NTL-WAS: sum_k p_k |k - y| (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    return (torch.softmax(z, dim=-1) * (k - y.to(z.dtype)[:, None]).abs()).sum(dim=-1)


def ntl_mse_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None) -> Tensor:
    """NTL-MSE: (sum_k p_k k - y)^2 (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    return ((torch.softmax(z, dim=-1) * k).sum(dim=-1) - y.to(z.dtype)) ** 2


def dist2_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None, tau: float = 1.0) -> Tensor:
    """DIST2: KL(q || p), q_k proportional to exp(-(k - y)^2 / tau) (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    log_q = torch.log_softmax(-((k - y.to(z.dtype)[:, None]) ** 2) / tau, dim=-1)
    return (log_q.exp() * (log_q - torch.log_softmax(z, dim=-1))).sum(dim=-1)


TermFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LossSpec:
    """Which digit term (if any), its lambda, and the digit vocabulary it reads."""

    type: str = "ce"
    weight: float = 0.0
    tau: float = 1.0
    vocab: Optional[DigitVocab] = None

    def __post_init__(self):
        if self.type not in TERM_TYPES + ("ce",):
            raise ValueError(f"unknown loss type {self.type!r}")
        if self.type != "ce" and self.vocab is None:
            raise ValueError(f"loss type {self.type!r} needs a DigitVocab")

    @property
    def has_term(self) -> bool:
        return self.type != "ce"

    @property
    def term(self) -> TermFn:
        """Per-position term function (z [N,10], y [N], w [N]) -> [N]."""
        if self.type == "del":
            return del_term
        if self.type == "ntl_was":
            return ntl_was_term
        if self.type == "ntl_mse":
            return ntl_mse_term
        if self.type == "dist2":
            return functools.partial(dist2_term, tau=self.tau)
        raise ValueError("loss type 'ce' has no digit term")


def make_term(loss_cfg, vocab: Optional[DigitVocab]) -> LossSpec:
    """LossSpec from a recipe.LossConfig (vocab may be None only for type 'ce')."""
    if loss_cfg.type != "ce" and vocab is None:
        raise UserError(f"loss.type {loss_cfg.type!r} needs single-token digits, but no digit vocabulary was found",
                        fix="Use a tokenizer with single-digit tokens or set loss.type: ce.")
    return LossSpec(type=loss_cfg.type, weight=float(loss_cfg.weight or 0.0), tau=float(loss_cfg.tau), vocab=vocab)


# ---------------------------------------------------------------------------------------------------------
# Output layer pieces: digit logits from ten weight rows, chunked CE
# ---------------------------------------------------------------------------------------------------------


def _plain_linear(lm_head: nn.Module) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """(weight, bias) when lm_head is an ordinary float Linear; None for peft/bnb wrappers (use forward)."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(lm_head, nn.Linear) or not isinstance(weight, Tensor) or weight.ndim != 2:
        return None
    # bnb Linear4bit/8bit subclass nn.Linear but store packed integer weights
    if not weight.dtype.is_floating_point or type(weight) not in (Tensor, nn.Parameter):
        return None
    return weight, lm_head.bias


def digit_logits(hidden: Tensor, lm_head: nn.Module, digit_ids) -> Tensor:
    """[N, H] -> [N, 10] logits of '0'..'9', in fp32, from only the ten digit rows of the output weight."""
    ids = torch.as_tensor(digit_ids, device=hidden.device, dtype=torch.long)
    plain = _plain_linear(lm_head)
    if plain is None:
        # peft LoRA on the output layer or a quantised head: no plain rows to slice, so run the module on
        # the (few) digit rows and keep ten columns. Costs N_digits x V, not N x V.
        return lm_head(hidden).index_select(-1, ids).to(_compute_dtype(hidden.dtype))
    weight, bias = plain
    ct = _compute_dtype(hidden.dtype)
    b = bias.index_select(0, ids).to(ct) if bias is not None else None
    return F.linear(hidden.to(ct), weight.index_select(0, ids).to(ct), b)


def _chunk_ce(lm_head: nn.Module, h: Tensor, t: Tensor) -> Tensor:
    logits = lm_head(h)
    return F.cross_entropy(logits.to(_compute_dtype(logits.dtype)), t, reduction="sum")


def chunked_ce_sum(hidden: Tensor, lm_head: nn.Module, targets: Tensor, chunk_size: int) -> Tensor:
    """Sum of CE over rows of hidden [N, H], never holding more than chunk_size x V logits.

    Each chunk is checkpointed, so backward recomputes its logits instead of keeping all of them alive.
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0  # in the graph, no NaN
    total = None
    recompute = torch.is_grad_enabled()
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]
        part = checkpoint(_chunk_ce, lm_head, h, t, use_reentrant=False) if recompute else _chunk_ce(lm_head, h, t)
        total = part if total is None else total + part
    return total


def liger_importable() -> bool:
    """liger-kernel and Triton import (they need no GPU to import; kernels need CUDA or the interpreter)."""
    try:
        import liger_kernel.transformers.fused_linear_cross_entropy  # noqa: F401
        return True
    except Exception:
        return False


def resolve_fused(mode: str, device) -> bool:
    """Whether to use Liger kernels (fused linear CE + layer kernels).

    'auto': on CUDA when liger-kernel imports. 'on': insists; also allowed on the CPU under the Triton
    interpreter (TRITON_INTERPRET=1), which is far too slow to train with but runs the very same kernels,
    so the tests can check the fused path against the chunked one without a GPU. 'off': never.
    """
    if mode == "off":
        return False
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    have_liger = liger_importable()
    if cuda and have_liger:
        return True
    if mode == "on" and have_liger and interpreter_on():
        patch_interpreter()
        return True
    if mode == "on":
        why = ("liger-kernel is not installed (or Triton is missing)" if not have_liger else
               "there is no CUDA device (and TRITON_INTERPRET=1 is not set)")
        raise UserError(f"train.fused_loss is 'on' but {why}",
                        fix="Set train.fused_loss: auto (falls back to chunked CE), or install liger-kernel "
                        "(pip install liger-kernel) on a CUDA machine.")
    return False


def _liger_ce_sum(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor) -> Tensor:
    # Liger computes the CE gradient chunk by chunk in the forward pass, so the [N, V] logits never exist.
    # API: forward(lin_weight, _input, target, bias=None). Tested on the CPU under TRITON_INTERPRET=1.
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    out = LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, targets, bias)
    out = out[0] if isinstance(out, tuple) else out
    return out.float()


def loss_sums(hidden: Tensor, lm_head: nn.Module, labels: Tensor, spec: LossSpec, chunk_size: int = 1024,
              fused: bool = False) -> dict:
    """Per-micro-batch sums for the trainer: dict(ce_sum, term_sum, n_labels, n_digits).

    ``labels`` are aligned with ``hidden`` [B, T, H] (labels[:, t] is the target of hidden[:, t]). Only
    labelled rows go through the output layer; the digit term uses the ten digit rows only. ``fused`` (from
    ``resolve_fused``) selects Liger's fused CE when the head is a plain Linear.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} are not aligned")
    keep = labels != IGNORE
    h = hidden[keep]
    t = labels[keep]
    plain = _plain_linear(lm_head) if fused else None
    if plain is not None and h.shape[0] > 0:
        ce_sum = _liger_ce_sum(h, plain[0], plain[1], t)
    else:
        ce_sum = chunked_ce_sum(h, lm_head, t, chunk_size)
    if not spec.has_term:
        return dict(ce_sum=ce_sum, term_sum=hidden.new_zeros((), dtype=torch.float32), n_labels=int(t.numel()),
                    n_digits=0)
    dt = digit_targets(labels, spec.vocab)
    z = digit_logits(hidden[dt.mask], lm_head, spec.vocab.digit_ids)
    term_sum = spec.term(z, dt.targets, dt.weights).sum()  # empty sum = 0, still in the graph
    return dict(ce_sum=ce_sum, term_sum=term_sum, n_labels=int(t.numel()), n_digits=int(dt.targets.numel()))


# ---------------------------------------------------------------------------------------------------------
# Full-logits reference path and the public loss modules
# ---------------------------------------------------------------------------------------------------------


def _gather_digit_columns(logits: Tensor, mask: Tensor, vocab: DigitVocab) -> Tensor:
    """[B, T, V] or already-gathered [B, T, 10] -> [N, 10] in fp32; only ten columns are ever upcast."""
    if logits.shape[:-1] != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(mask.shape)} are not aligned "
                         "(logits[:, t] must score labels[:, t]; shift before calling)")
    if logits.shape[-1] != 10:
        ids = torch.tensor(vocab.digit_ids, device=logits.device, dtype=torch.long)
        logits = logits.index_select(-1, ids)
    return logits[mask].to(_compute_dtype(logits.dtype))


def term_mean(logits: Tensor, labels: Tensor, spec: LossSpec) -> Tensor:
    """Mean of the spec's digit term over digit-label positions; 0 (in the graph) when there are none."""
    dt = digit_targets(labels, spec.vocab)
    z = _gather_digit_columns(logits, dt.mask, spec.vocab)
    return spec.term(z, dt.targets, dt.weights).sum() / max(int(dt.targets.numel()), 1)


def full_logits_loss(logits: Tensor, labels: Tensor, spec: LossSpec) -> dict:
    """Reference path from full logits [B, T, V]: dict(loss, ce, term) with ce/term means over their items."""
    flat = logits.reshape(-1, logits.shape[-1])
    n = int((labels != IGNORE).sum())
    ce = F.cross_entropy(flat.to(_compute_dtype(flat.dtype)), labels.reshape(-1), ignore_index=IGNORE,
                         reduction="sum") / max(n, 1)
    if not spec.has_term:
        return dict(loss=ce, ce=ce, term=torch.zeros_like(ce))
    term = term_mean(logits, labels, spec)
    return dict(loss=ce + spec.weight * term, ce=ce, term=term)


class _DigitLoss(nn.Module):
    """Base: find digit labels, gather ten logit columns, average a per-position term. No lambda applied."""

    def __init__(self, tokenizer, vocab: Optional[DigitVocab], loss_type: str, tau: float = 1.0):
        super().__init__()
        if vocab is None:
            if tokenizer is None:
                raise ValueError("pass a tokenizer or vocab=DigitVocab(...)")
            vocab = DigitVocab.from_tokenizer(tokenizer, purpose=type(self).__name__)
        self.vocab = vocab
        self.spec = LossSpec(type=loss_type, weight=1.0, tau=tau, vocab=vocab)

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        """logits [B, T, V] (or [B, T, 10] digit columns) aligned with labels [B, T] -> scalar fp32 term."""
        return term_mean(logits, labels, self.spec)


class DigitEntropyLoss(_DigitLoss):
    """DEL term (without lambda): mean over digit positions x 10 candidates of w * p * BCE."""

    def __init__(self, tokenizer=None, *, vocab: Optional[DigitVocab] = None):
        super().__init__(tokenizer, vocab, "del")


class NumberTokenLoss(_DigitLoss):
    """NTL term (without lambda): kind 'was' (Wasserstein) or 'mse', mean over digit-label positions."""

    def __init__(self, tokenizer=None, kind: str = "was", *, vocab: Optional[DigitVocab] = None):
        if kind not in ("was", "mse"):
            raise ValueError(f"kind must be 'was' or 'mse', not {kind!r}")
        super().__init__(tokenizer, vocab, f"ntl_{kind}")


class Dist2Loss(_DigitLoss):
    """DIST2 term (without alpha): KL(q || p) with q_k proportional to exp(-(k - y)^2 / tau)."""

    def __init__(self, tokenizer=None, tau: float = 1.0, *, vocab: Optional[DigitVocab] = None):
        super().__init__(tokenizer, vocab, "dist2", tau)
