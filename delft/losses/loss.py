"""Digit-aware losses: DEL, NTL (WAS/MSE) and DIST2, plus a memory-lean CE, behind one training loss object.

Formulas follow docs/losses.md. Shapes: logits[:, t] scores labels[:, t] (the caller shifts, like ntloss);
IGNORE (-100) labels are ignored. All digit terms are computed in fp32 (fp64 inputs stay fp64), from the
logit columns of the number tokens only: the ten digits, or on tokenizers with multi-digit number tokens
(Llama-3: 1,110 of one to three digits) per digit *character* via delft.numbers.tokens.char_logits.

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
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from delft.errors import UserError
from delft.losses.heads import chunked_ce_sum, digit_logits, liger_ce_sum, plain_linear, resolve_fused
from delft.losses.registry import CE, CHUNKED_CE, FUSED_CE, GLOBAL, LOSS_TYPES, NORMALISATIONS, REFERENCE, LossType
from delft.losses.terms import TERMS, TermFn, compute_dtype
from delft.numbers.digits import DEFAULT_PLACE_WEIGHT_CAP, PLACE_WEIGHTS, place_weight
from delft.numbers.tokens import (
    IGNORE,
    CharTable,
    NumberVocab,
    char_logits,
    count_digit_chars,
    number_targets,
    offered,
)


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
        z = z.to(compute_dtype(z.dtype))
        p_y = torch.softmax(z, dim=-1).gather(-1, y.view(-1, 1).to(z.device))
        return float(z.mean(dim=-1).sum()), float(p_y.sum())


class Loss:
    """CE + lambda x a digit term, built once (``from_recipe``): what the trainer, the bench and the tests use.

    ``type`` names a delft.losses.registry.LOSS_TYPES entry; ``params`` are its options (dist2: tau). ``fused``
    selects Liger's fused linear CE (see ``resolve_fused``) where the output layer is a plain Linear and
    gradients are being taken; otherwise the output layer runs in checkpointed chunks of ``chunk_size`` rows.
    ``ran`` collects the CE paths that training micro-batches actually took. ``vocab`` is a DigitVocab or a
    NumberVocab (delft.numbers.tokens); the digit term is per digit character either way (``numbers``).

    ``normalisation`` 'global' (delft) or 'reference' (the DEL reference under HF Trainer: see ``means``);
    ``grad_accum`` and ``world_size`` only matter for 'reference'. ``world_size`` is the number of processes
    whose gradients are summed into one optimizer step (delft.training.distributed): the reference's GPU count. ``place_weights`` / ``place_weight_cap``
    choose the place weight (delft.numbers.digits.place_weight) that the DEL forms read.
    """

    def __init__(self, type: str = CE, weight: float = 0.0, vocab: Optional[NumberVocab] = None, *,
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
            raise ValueError(f"loss type {type!r} needs a NumberVocab")
        self.type, self.weight, self.vocab, self.params = type, float(weight), vocab, params
        self.numbers: Optional[NumberVocab] = vocab
        self._tables: dict[str, CharTable] = {}
        self.chunk_size, self.fused = chunk_size, fused
        self.ran: set[str] = set()
        if normalisation not in NORMALISATIONS or place_weights not in PLACE_WEIGHTS:
            raise ValueError(f"normalisation {normalisation!r} / place weights {place_weights!r} unknown")
        self.normalisation, self.grad_accum, self.world_size = normalisation, int(grad_accum), int(world_size)
        self.weigh = functools.partial(place_weight, mode=place_weights, cap=float(place_weight_cap))

    @classmethod
    def from_config(cls, loss_cfg, vocab: Optional[NumberVocab], chunk_size: int = 1024,
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
    def from_recipe(cls, recipe, vocab: Optional[NumberVocab], device, world_size: int = 1) -> "Loss":
        """The recipe's loss on ``device`` for a run on ``world_size`` processes (raises UserError for
        train.fused_loss 'on' where Liger cannot run)."""
        if vocab is not None:  # places through the trained text's number form: reversed digits keep their value
            vocab = vocab.written_as(recipe.data.numbers)
        if LOSS_TYPES[recipe.loss.type].replaces_ce and recipe.train.fused_loss == "on":
            raise UserError(f"train.fused_loss is 'on' but loss.type {recipe.loss.type!r} weighs each label's CE by "
                            "its probability, which Liger's fused cross-entropy cannot do", "train.fused_loss",
                            "Set train.fused_loss: auto (dft then takes the chunked path) or off.")
        return cls.from_config(recipe.loss, vocab, recipe.train.loss_chunk_size,
                               resolve_fused(recipe.train.fused_loss, device), recipe.train.grad_accum, world_size)

    @property
    def has_term(self) -> bool:
        return self.kind.has_term

    @property
    def dft(self) -> bool:
        """CE itself is DFT's probability-weighted CE (per label, over the whole optimizer batch like CE)."""
        return self.kind.replaces_ce

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
        # dft weighs each label's CE by its probability: Liger's fused CE has no per-row weight, so it stays chunked
        plain = plain_linear(lm_head) if self.fused and training and h.shape[0] > 0 and not self.dft else None
        if plain is not None:
            ce_sum, path = liger_ce_sum(h, plain[0], plain[1], t), FUSED_CE
        else:
            ce_sum, path = chunked_ce_sum(h, lm_head, t, self.chunk_size, self.dft), CHUNKED_CE
        if training and h.shape[0] > 0:
            self.ran.add(path)
        if not self.has_term:
            return Sums(ce_sum, hidden.new_zeros((), dtype=torch.float32), Counts(int(t.numel()), 0))
        term_sum, z, y = self.term_sums(hidden, lm_head, labels)
        return self.micro_sums(ce_sum, term_sum, Counts(int(t.numel()), int(y.numel())), z, y)

    def term_sums(self, hidden: Tensor, lm_head: nn.Module, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(the digit term summed over every digit character of ``labels``, their digit logits [C, 10], their gold
        digits [C]), from the hidden states aligned with ``labels`` and the output layer's number-token rows only."""
        nt = number_targets(labels, self.numbers, self.weigh)
        z, y = self.digit_chars(digit_logits(hidden[nt.mask], lm_head, self.numbers.ids), nt.gold)
        return self.term(z, y, nt.weights).sum(), z, y  # an empty sum is 0, still in the graph

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
