"""Digit-aware losses: DEL, NTL (WAS/MSE) and DIST2, plus a memory-lean CE, behind one training loss object.

Formulas follow docs/losses.md. Shapes: logits[:, t] scores labels[:, t] (the caller shifts, like ntloss);
IGNORE (-100) labels are ignored. All digit terms are computed in fp32 (fp64 inputs stay fp64), from the
logit columns of the number tokens only: the ten digits, or on tokenizers with multi-digit number tokens
(Llama-3: 1,110 of one to three digits) per digit *character* via delft.numtokens.char_logits.

``Loss`` is built once from the recipe (type, lambda, options, chunk size, CE path). Over one optimizer batch,
    loss = CE_sum / N_labels + lambda * term_sum / N_digits
with N_labels / N_digits counted over the WHOLE optimizer batch (``Loss.count``) before the micro-batches run,
so the gradient does not depend on how the batch is split (loss.normalisation 'global'; 'reference' copies the
DEL reference's per-micro-batch scaling, ``Loss.means``). ``Loss.sums`` gives one micro-batch's sums and
``Loss.combine`` turns sums and counts into that loss; nothing else writes the formula.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from delft.data import IGNORE
from delft.digits import DEFAULT_PLACE_WEIGHT_CAP, PLACE_WEIGHTS, DigitVocab, place_weight
from delft.errors import UserError
from delft.loss_types import (CE, CHUNKED_CE, FUSED_CE, GLOBAL, LOSS_TYPES, NORMALISATIONS, REFERENCE, LossType,
                              fused_applies)
from delft.numtokens import CharTable, NumberVocab, char_logits, count_digit_chars, number_targets, number_vocab, \
    offered
from delft.triton_cpu import interpreter_on, patch_interpreter


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, fp64 kept (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Targets from labels
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Per-position terms on the ten digit logits: z [N, 10], y [N] (0..9), w [N] (place weight, DEL only) -> [N]
# ---------------------------------------------------------------------------------------------------------


def _prep(z: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = z.to(_compute_dtype(z.dtype))
    return z, y.to(device=z.device, dtype=torch.long)


TermFn = Callable[..., Tensor]
TERMS: dict[str, TermFn] = {}  # loss type name (delft.loss_types.LOSS_TYPES) -> per-position term


def term_of(name: str):
    """Register a per-position term function for the loss type ``name``."""
    if name not in LOSS_TYPES or not LOSS_TYPES[name].has_term:
        raise ValueError(f"{name!r} is not a digit-term type of delft.loss_types.LOSS_TYPES")

    def register(fn: TermFn) -> TermFn:
        TERMS[name] = fn
        return fn
    return register


@term_of("del")
def del_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """DEL: w * mean_k p_k * BCEWithLogits(z_k, 1[k == y]); p not detached (reference code)."""
    z, y = _prep(z, y)
    p = torch.softmax(z, dim=-1)
    b = F.binary_cross_entropy_with_logits(z, F.one_hot(y, 10).to(z.dtype), reduction="none")
    # mean over k here, so a mean over positions equals the mean over all N x 10 entries
    return w.to(z) * (p * b).mean(dim=-1)


# Why two more DEL forms (docs/losses.md, "Shift invariance"): BCE-with-logits on raw logits changes when all ten
# digit logits move together, so ``del`` can lower itself by shifting them (an LM's raw digit logits sit far
# from 0), and once they are negative the correct digit's own p_y * softplus(-z_y) falls as p_y falls, so
# dDEL/dz_y > 0: descent pushes the correct digit down. Both forms below depend on z only through the digit
# softmax (or centred logits) and detach p where it is the weight, so that cannot happen.


@term_of("del_prob")
def del_prob_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """w * mean_k sg(p_k) * BCE(p_k, 1[k == y]), p = softmax over the ten digits, sg = detach.

    Shift-invariant (p is). Gradient, with c_k = w sg(p_k) / 10:
        dL/dz_y = -c_y (1 - p_y) - sum_{k != y} c_k p_k p_y / (1 - p_k)  < 0  for every z,
    so descent always raises the correct digit; at equal logits (p = 0.1) it is -w / 100.
    """
    z, y = _prep(z, y)
    log_p = torch.log_softmax(z, dim=-1)
    hit = F.one_hot(y, 10).to(torch.bool)
    bce = -torch.where(hit, log_p, log_miss(z))
    return w.to(z) * (log_p.exp().detach() * bce).mean(dim=-1)


def log_miss(z: Tensor) -> Tensor:
    """log(1 - p_k) for every k of z [N, 10]: logsumexp of the other nine logits minus logsumexp of all ten.

    Exact where p_k rounds to 1. The usual log(-expm1(log p_k)) cancels there: log p_k loses its digits once a
    wrong digit is ~15 nats ahead (fp32), and the correct digit's gradient is cut when it is needed most.
    """
    others = z.unsqueeze(-2).expand(*z.shape[:-1], 10, 10)
    eye = torch.eye(10, dtype=torch.bool, device=z.device)
    return torch.logsumexp(others.masked_fill(eye, float("-inf")), dim=-1) - torch.logsumexp(z, dim=-1, keepdim=True)


def expected(z: Tensor, values: Tensor) -> Tensor:
    """E_p[values] over the digit softmax of z [N, 10], values [N, 10], centred on the most likely digit's value.

    The same number as (softmax(z) * values).sum(-1), but its gradient p_j (v_j - E[v]) no longer subtracts two
    nearly equal numbers when one digit holds almost all the mass (autograd's softmax backward would).
    """
    anchor = values.gather(-1, z.argmax(dim=-1, keepdim=True))
    return (torch.softmax(z, dim=-1) * (values - anchor)).sum(dim=-1) + anchor.squeeze(-1)


@term_of("del_centered")
def del_centered_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """w * mean_k sg(p_k) * BCEWithLogits(z_k - mean_j z_j, 1[k == y]): the reference's binary CE per candidate
    on logits centred over the ten digits, weight detached.

    Shift-invariant (centring removes a common offset). With u = z - mean z, s = sigmoid, c_k = w sg(p_k) / 10:
        dL/dz_y = 0.9 c_y (s(u_y) - 1) - 0.1 sum_{k != y} c_k s(u_k)  < 0  for every z.
    """
    z, y = _prep(z, y)
    u = z - z.mean(dim=-1, keepdim=True)
    b = F.binary_cross_entropy_with_logits(u, F.one_hot(y, 10).to(z.dtype), reduction="none")
    return w.to(z) * (torch.softmax(z, dim=-1).detach() * b).mean(dim=-1)


@term_of("ntl_was")
def ntl_was_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None) -> Tensor:
    """NTL-WAS: sum_k p_k |k - y| (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    return expected(z, (k - y.to(z.dtype)[:, None]).abs())


@term_of("ntl_mse")
def ntl_mse_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None) -> Tensor:
    """NTL-MSE: (sum_k p_k k - y)^2 (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    return (expected(z, k.expand_as(z)) - y.to(z.dtype)) ** 2


@term_of("dist2")
def dist2_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None, tau: float = 1.0) -> Tensor:
    """DIST2: KL(q || p), q_k proportional to exp(-(k - y)^2 / tau) (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    log_q = torch.log_softmax(-((k - y.to(z.dtype)[:, None]) ** 2) / tau, dim=-1)
    return (log_q.exp() * (log_q - torch.log_softmax(z, dim=-1))).sum(dim=-1)


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
    """Whether to use Liger kernels (fused linear CE + layer kernels) on ``device``: delft.loss_types.fused_applies
    with what this machine has; train.fused_loss 'on' that cannot be honoured is a UserError."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    fused, why = fused_applies(mode, cuda, mode != "off" and liger_importable(), interpreter_on())
    if why:
        raise UserError(f"train.fused_loss is 'on' but {why}",
                        fix="Set train.fused_loss: auto (falls back to chunked CE), or install liger-kernel "
                        "(pip install liger-kernel) on a CUDA machine.")
    if fused and not cuda:
        patch_interpreter()
    return fused


def _liger_ce_sum(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor) -> Tensor:
    # Liger computes the CE gradient chunk by chunk in the forward pass, so the [N, V] logits never exist.
    # API: forward(lin_weight, _input, target, bias=None). Tested on the CPU under TRITON_INTERPRET=1.
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    out = LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, targets, bias)
    out = out[0] if isinstance(out, tuple) else out
    return out.float()


class Counts(NamedTuple):
    """Positions with a label and positions with a digit label: the denominators of the loss."""

    labels: int
    digits: int

    def __add__(self, other: "Counts") -> "Counts":  # type: ignore[override]
        return Counts(self.labels + other.labels, self.digits + other.digits)


def _scalar(x) -> float:
    return float(x.detach()) if isinstance(x, Tensor) else float(x)


@dataclass
class Sums:
    """One micro-batch's (or several, added) CE and digit-term sums with its own counts.

    ``ce`` / ``term`` / ``term_means`` are tensors in the autograd graph from ``Loss.sums``, floats after
    ``detach``. ``term_means`` adds up each micro-batch's own term mean and ``micro`` counts the micro-batches
    (loss.normalisation 'reference'). ``digit_logit`` / ``p_digit`` are plain sums over digit labels of the mean
    raw digit logit and of P(correct digit | digits), for the log (no gradient).
    """

    ce: Any
    term: Any
    counts: Counts
    term_means: Any = 0.0
    micro: int = 0
    digit_logit: float = 0.0
    p_digit: float = 0.0

    def __add__(self, other: "Sums") -> "Sums":
        return Sums(self.ce + other.ce, self.term + other.term, self.counts + other.counts,
                    self.term_means + other.term_means, self.micro + other.micro,
                    self.digit_logit + other.digit_logit, self.p_digit + other.p_digit)

    def detach(self) -> "Sums":
        """Floats, out of the graph: for logging and for adding up over batches."""
        return Sums(_scalar(self.ce), _scalar(self.term), self.counts, _scalar(self.term_means), self.micro,
                    self.digit_logit, self.p_digit)

    def as_floats(self) -> list[float]:
        """Every field as one flat list (counts included), so ranks can sum the whole object in one all-reduce:
        a field added here cannot be left out of the distributed log."""
        d = self.detach()
        return [d.ce, d.term, float(d.counts.labels), float(d.counts.digits), d.term_means, float(d.micro),
                d.digit_logit, d.p_digit]

    @classmethod
    def from_floats(cls, v: list[float]) -> "Sums":
        """The inverse of ``as_floats`` (counts back to integers)."""
        ce, term, labels, digits, term_means, micro, digit_logit, p_digit = v
        return cls(ce, term, Counts(round(labels), round(digits)), term_means, round(micro), digit_logit, p_digit)


def digit_stats(z: Tensor, y: Tensor) -> tuple[float, float]:
    """(sum over rows of the mean raw digit logit, sum of P(y | the ten digits)) of z [N, 10]: for the log."""
    with torch.no_grad():
        z = z.to(_compute_dtype(z.dtype))
        p_y = torch.softmax(z, dim=-1).gather(-1, y.view(-1, 1).to(z.device))
        return float(z.mean(dim=-1).sum()), float(p_y.sum())


class Loss:
    """CE + lambda x a digit term, built once (``from_recipe``): what the trainer, the bench and the tests use.

    ``type`` names a delft.loss_types.LOSS_TYPES entry; ``params`` are its options (dist2: tau). ``fused``
    selects Liger's fused linear CE (see ``resolve_fused``) where the output layer is a plain Linear and
    gradients are being taken; otherwise the output layer runs in checkpointed chunks of ``chunk_size`` rows.
    ``ran`` collects the CE paths that training micro-batches actually took. ``vocab`` is a DigitVocab or a
    NumberVocab (delft.numtokens); the digit term is per digit character either way (``numbers``).

    ``normalisation`` 'global' (delft) or 'reference' (the DEL reference under HF Trainer: see ``means``);
    ``grad_accum`` and ``world_size`` only matter for 'reference'. ``world_size`` is the number of processes
    whose gradients are summed into one optimizer step (delft.distributed): the reference's GPU count. ``place_weights`` / ``place_weight_cap``
    choose the place weight (delft.digits.place_weight) that the DEL forms read.
    """

    def __init__(self, type: str = CE, weight: float = 0.0, vocab: Optional[DigitVocab | NumberVocab] = None, *,
                 chunk_size: int = 1024, fused: bool = False, normalisation: str = GLOBAL, grad_accum: int = 1,
                 world_size: int = 1, place_weights: str = "reference",
                 place_weight_cap: float = DEFAULT_PLACE_WEIGHT_CAP, **params):
        if type not in LOSS_TYPES:
            raise ValueError(f"unknown loss type {type!r}")
        self.kind: LossType = LOSS_TYPES[type]
        unknown = set(params) - set(self.kind.params)
        if unknown:
            raise ValueError(f"loss type {type!r} takes no {', '.join(sorted(unknown))}")
        if self.kind.has_term and vocab is None:
            raise ValueError(f"loss type {type!r} needs a DigitVocab or NumberVocab")
        self.type, self.weight, self.vocab, self.params = type, float(weight), vocab, params
        self.numbers: Optional[NumberVocab] = number_vocab(vocab)
        self._tables: dict[str, CharTable] = {}
        self.chunk_size, self.fused = chunk_size, fused
        self.ran: set[str] = set()
        if normalisation not in NORMALISATIONS or place_weights not in PLACE_WEIGHTS:
            raise ValueError(f"normalisation {normalisation!r} / place weights {place_weights!r} unknown")
        self.normalisation, self.grad_accum, self.world_size = normalisation, int(grad_accum), int(world_size)
        self.weigh = functools.partial(place_weight, mode=place_weights, cap=float(place_weight_cap))

    @classmethod
    def from_config(cls, loss_cfg, vocab: Optional[DigitVocab | NumberVocab], chunk_size: int = 1024,
                    fused: bool = False, grad_accum: int = 1, world_size: int = 1):
        """From a recipe.LossConfig; vocab may be None only for type 'ce'."""
        kind = LOSS_TYPES[loss_cfg.type]
        if kind.has_term and vocab is None:
            raise UserError(f"loss.type {loss_cfg.type!r} needs single-token digits or number tokens, but no digit "
                            "vocabulary was found", fix="Use a tokenizer that writes numbers with digit-only tokens "
                            "or set loss.type: ce.")
        return cls(loss_cfg.type, loss_cfg.weight or 0.0, vocab, chunk_size=chunk_size, fused=fused,
                   normalisation=loss_cfg.normalisation, grad_accum=grad_accum, world_size=world_size,
                   place_weights=loss_cfg.place_weights, place_weight_cap=loss_cfg.place_weight_cap,
                   **{p: getattr(loss_cfg, p) for p in kind.params})

    @classmethod
    def from_recipe(cls, recipe, vocab: Optional[DigitVocab | NumberVocab], device, world_size: int = 1) -> "Loss":
        """The recipe's loss on ``device`` for a run on ``world_size`` processes (raises UserError for
        train.fused_loss 'on' where Liger cannot run)."""
        return cls.from_config(recipe.loss, vocab, recipe.train.loss_chunk_size,
                               resolve_fused(recipe.train.fused_loss, device), recipe.train.grad_accum, world_size)

    @property
    def has_term(self) -> bool:
        return self.kind.has_term

    @property
    def term(self) -> TermFn:
        """Per-position term function (z [N,10], y [N], w [N]) -> [N], with this loss's options bound."""
        if not self.has_term:
            raise ValueError("loss type 'ce' has no digit term")
        return functools.partial(TERMS[self.type], **self.params)

    @property
    def path_ran(self) -> Optional[str]:
        """The CE path training took ('chunked_ce', 'fused_linear_ce'; both joined by '+'), None before any."""
        return "+".join(sorted(self.ran)) or None

    def count(self, labels: Tensor) -> Counts:
        """Counts of ``labels`` (aligned with the hidden states): sum them over the optimizer batch.
        The digit count is N_digits, the digit characters of the number-token labels."""
        n_labels = int((labels != IGNORE).sum())
        return Counts(n_labels, count_digit_chars(labels, self.numbers) if self.numbers is not None else 0)

    def _table(self, device) -> CharTable:
        key = str(device)
        if key not in self._tables:
            self._tables[key] = self.numbers.char_table(device)
        return self._tables[key]

    def digit_chars(self, z: Tensor, gold: Tensor) -> tuple[Tensor, Tensor]:
        """(digit logits [C, 10], gold digits [C]) per digit character, from number-token logits z [P, T].
        On single-digit tokenizers exactly z and the gold digits."""
        table = self._table(z.device)
        chars = char_logits(z, gold, table)
        return (chars.logits if table.complete else offered(chars.logits)), chars.digit

    def sums(self, hidden: Tensor, lm_head: nn.Module, labels: Tensor) -> Sums:
        """One micro-batch's CE and digit-term sums; ``labels`` aligned with ``hidden`` [B, T, H].

        Only labelled rows go through the output layer; the digit term uses the number-token rows only. Without
        gradients (validation) the chunked path runs: Liger computes its gradient inside the forward pass.
        """
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} are not aligned")
        keep = labels != IGNORE
        h, t = hidden[keep], labels[keep]
        training = torch.is_grad_enabled()
        plain = _plain_linear(lm_head) if self.fused and training and h.shape[0] > 0 else None
        if plain is not None:
            ce_sum, path = _liger_ce_sum(h, plain[0], plain[1], t), FUSED_CE
        else:
            ce_sum, path = chunked_ce_sum(h, lm_head, t, self.chunk_size), CHUNKED_CE
        if training and h.shape[0] > 0:
            self.ran.add(path)
        if not self.has_term:
            return Sums(ce_sum, hidden.new_zeros((), dtype=torch.float32), Counts(int(t.numel()), 0))
        nt = number_targets(labels, self.numbers, self.weigh)
        z, y = self.digit_chars(digit_logits(hidden[nt.mask], lm_head, self.numbers.ids), nt.gold)
        term_sum = self.term(z, y, nt.weights).sum()  # empty sum = 0, still in the graph
        return self.micro_sums(ce_sum, term_sum, Counts(int(t.numel()), int(y.numel())), z, y)

    def micro_sums(self, ce_sum: Tensor, term_sum: Tensor, counts: Counts, z: Tensor, y: Tensor) -> Sums:
        """One micro-batch's Sums from its CE and term sums and its per-character digit logits z [N, 10] (targets y)."""
        mean = term_sum / counts.digits if counts.digits else term_sum * 0
        return Sums(ce_sum, term_sum, counts, mean, 1, *digit_stats(z, y))

    @property
    def term_scale(self) -> float:
        """What multiplies lambda x term in the loss: 1 ('global'), accumulation steps x world size ('reference')."""
        return float(self.grad_accum * self.world_size) if self.normalisation == REFERENCE else 1.0

    def means(self, sums: Sums, counts: Counts) -> dict:
        """{"ce", "term", "loss", "digit_logit", "p_digit"} of an optimizer batch whose counts are ``counts``.

        CE per label; 'global': term per digit label, loss = ce + lambda * term. 'reference': term = the mean
        of the micro-batches' own term means, loss = ce + lambda * grad_accum * world_size * term, what the DEL
        reference's code optimises under HF Trainer (docs/losses.md). Tensors in the graph from ``sums``'
        tensors, floats from detached ones. The digit statistics are per digit label (None without digits).
        """
        ce = sums.ce / max(1, counts.labels)
        if self.normalisation == REFERENCE:
            term = sums.term_means / sums.micro if sums.micro else sums.term * 0
        else:
            term = sums.term / counts.digits if counts.digits else sums.term * 0
        loss = ce + self.weight * self.term_scale * term if self.weight > 0 and counts.digits else ce
        n = sums.counts.digits
        return {"ce": ce, "term": term, "loss": loss, "digit_logit": sums.digit_logit / n if n else None,
                "p_digit": sums.p_digit / n if n else None}

    def combine(self, sums: Sums, counts: Counts):
        """The loss to back-propagate for one micro-batch's ``sums`` in an optimizer batch with ``counts``
        (the whole step's counts, over every micro-batch and rank).

        'reference': the micro-batch adds lambda x its own term mean (HF Trainer neither divides by the
        accumulation steps nor normalises the term globally). delft sums the ranks' gradients where DDP
        averages them and the Trainer multiplies by the process count, so the step's gradient is that of
        lambda x grad_accum x world_size x (mean of all micro-batch means): ``means``' loss.
        """
        if self.normalisation == REFERENCE:
            ce = sums.ce / max(1, counts.labels)
            return ce + self.weight * sums.term_means if self.weight > 0 and counts.digits else ce
        return self.means(sums, counts)["loss"]


# ---------------------------------------------------------------------------------------------------------
# Full-logits reference path and the public loss modules
# ---------------------------------------------------------------------------------------------------------


def _gather_digit_columns(logits: Tensor, mask: Tensor, vocab: NumberVocab) -> Tensor:
    """[B, T, V] or already-gathered [B, T, n] (n number tokens) -> [N, n] in fp32; only n columns are upcast."""
    if logits.shape[:-1] != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(mask.shape)} are not aligned "
                         "(logits[:, t] must score labels[:, t]; shift before calling)")
    if logits.shape[-1] != len(vocab.ids):
        ids = torch.tensor(vocab.ids, device=logits.device, dtype=torch.long)
        logits = logits.index_select(-1, ids)
    return logits[mask].to(_compute_dtype(logits.dtype))


def _term_sum(logits: Tensor, labels: Tensor, loss: Loss) -> tuple[Tensor, Tensor, Tensor]:
    """(term sum, per-character digit logits [N, 10], targets [N]) from full logits."""
    nt = number_targets(labels, loss.numbers, loss.weigh)
    z, y = loss.digit_chars(_gather_digit_columns(logits, nt.mask, loss.numbers), nt.gold)
    return loss.term(z, y, nt.weights).sum(), z, y


def term_mean(logits: Tensor, labels: Tensor, loss: Loss) -> Tensor:
    """Mean of the loss's digit term over digit-label positions; 0 (in the graph) when there are none."""
    total, _, y = _term_sum(logits, labels, loss)
    return total / max(int(y.numel()), 1)


def full_logits_loss(logits: Tensor, labels: Tensor, loss: Loss) -> dict:
    """Reference path from full logits [B, T, V] of a whole batch: ``loss.means`` (loss, ce, term) as tensors."""
    flat = logits.reshape(-1, logits.shape[-1])
    ce_sum = F.cross_entropy(flat.to(_compute_dtype(flat.dtype)), labels.reshape(-1), ignore_index=IGNORE,
                             reduction="sum")
    counts = loss.count(labels)
    if not loss.has_term:
        return loss.means(Sums(ce_sum, torch.zeros_like(ce_sum), counts), counts)
    term_sum, z, y = _term_sum(logits, labels, loss)
    return loss.means(loss.micro_sums(ce_sum, term_sum, counts, z, y), counts)


class _DigitLoss(nn.Module):
    """Base: find digit labels, gather their logit columns, average a per-character term. No lambda applied.

    Single-digit tokenizers and number tokens of 1-3 digits (Llama-3) both work: the term is per digit
    character (delft.numtokens); tokenizers that glue digits to other characters are refused with examples.
    """

    def __init__(self, tokenizer, vocab: Optional[DigitVocab | NumberVocab], loss_type: str, **params):
        super().__init__()
        if vocab is None:
            if tokenizer is None:
                raise ValueError("pass a tokenizer or vocab=DigitVocab(...) / NumberVocab(...)")
            vocab = NumberVocab.from_tokenizer(tokenizer, purpose=type(self).__name__)
        self.vocab = vocab
        self.loss = Loss(loss_type, 1.0, vocab, **params)

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        """logits [B, T, V] (or [B, T, n]: the number-token columns) aligned with labels [B, T] -> scalar fp32."""
        return term_mean(logits, labels, self.loss)


class DigitEntropyLoss(_DigitLoss):
    """DEL term (without lambda): mean over digit positions x 10 candidates of w * p * BCE."""

    def __init__(self, tokenizer=None, *, vocab: Optional[DigitVocab | NumberVocab] = None):
        super().__init__(tokenizer, vocab, "del")


class NumberTokenLoss(_DigitLoss):
    """NTL term (without lambda): kind 'was' (Wasserstein) or 'mse', mean over digit-label positions."""

    def __init__(self, tokenizer=None, kind: str = "was", *, vocab: Optional[DigitVocab | NumberVocab] = None):
        if kind not in ("was", "mse"):
            raise ValueError(f"kind must be 'was' or 'mse', not {kind!r}")
        super().__init__(tokenizer, vocab, f"ntl_{kind}")


class Dist2Loss(_DigitLoss):
    """DIST2 term (without alpha): KL(q || p) with q_k proportional to exp(-(k - y)^2 / tau)."""

    def __init__(self, tokenizer=None, tau: float = 1.0, *, vocab: Optional[DigitVocab | NumberVocab] = None):
        super().__init__(tokenizer, vocab, "dist2", tau=tau)
