"""delft's losses without delft's loop: ``digit_term_sum`` (the term's sum and count from hidden states and the
output layer, for callers that normalise over their own global count and never build full logits), ``DigitLoss``
(any registry type, CE included, as one ``nn.Module``), the full-logits path, and the single-term modules
``DigitEntropyLoss``, ``NumberTokenLoss`` and ``Dist2Loss``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from delft.losses.heads import dft_sum
from delft.losses.loss import Loss, Sums
from delft.losses.misuse import callers_words
from delft.losses.registry import LOSS_TYPES
from delft.losses.terms import compute_dtype
from delft.numbers.tokens import IGNORE, NumberVocab, number_targets


def _gather_digit_columns(logits: Tensor, mask: Tensor, vocab: NumberVocab) -> Tensor:
    """[B, T, V] or already-gathered [B, T, n] (n number tokens) -> [N, n] in fp32; only n columns are upcast."""
    if logits.shape[:-1] != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(mask.shape)} are not aligned "
                         "(logits[:, t] must score labels[:, t]; shift before calling)")
    if logits.shape[-1] != len(vocab.ids):
        ids = torch.tensor(vocab.ids, device=logits.device, dtype=torch.long)
        logits = logits.index_select(-1, ids)
    return logits[mask].to(compute_dtype(logits.dtype))


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
    if loss.dft:
        ce_sum = dft_sum(flat.to(compute_dtype(flat.dtype)), labels.reshape(-1), IGNORE)
    else:
        ce_sum = F.cross_entropy(flat.to(compute_dtype(flat.dtype)), labels.reshape(-1), ignore_index=IGNORE,
                                 reduction="sum")
    counts = loss.count(labels)
    if not loss.has_term:
        return loss.means(Sums(ce_sum, torch.zeros_like(ce_sum), counts), counts)
    term_sum, z, y = _term_sum(logits, labels, loss)
    return loss.means(loss.micro_sums(ce_sum, term_sum, counts, z, y), counts)


def digit_term_sum(hidden: Tensor, lm_head: nn.Module, labels: Tensor, loss: Loss) -> tuple[Tensor, int]:
    """(the digit term of ``loss`` summed over the digit characters of ``labels``, how many there are).

    ``hidden`` [B, T, H] are the last hidden states (after the final norm) aligned with ``labels`` [B, T]
    (hidden[:, t] predicts labels[:, t]); only the number-token rows of ``lm_head`` are used, never full logits.
    Divide the sum by the count summed over the whole optimizer batch (every micro-batch, every rank) to get
    delft's per-digit mean, independent of how the batch is split.
    """
    if not loss.has_term:
        return hidden.new_zeros((), dtype=torch.float32), 0
    total, _, y = loss.term_sums(hidden, lm_head, labels)
    return total, int(y.numel())


class DigitLoss(nn.Module):
    """CE + weight x a digit term of any registry type (delft.losses.registry: del, del_prob, del_centered, ntl_was,
    ntl_mse, dist2, or ce alone), normalised as delft trains: CE per label, the term per digit character.

    ``DigitLoss(tokenizer, type="del_prob", weight=0.3, place_weights="capped", tau=...)``: the options are the
    ``loss:`` recipe keys (normalisation, place_weights, place_weight_cap, and the type's own, like dist2's tau);
    an unknown one is a ValueError naming it; ``weight`` defaults to the type's default. ``forward(logits, labels)`` takes full logits [B, T, V] aligned with labels
    (the caller shifts); ``sums(hidden, lm_head, labels)`` works from hidden states without full logits, for
    callers that add micro-batches up (``loss.means`` / ``loss.combine`` with the whole batch's ``loss.count``).
    """

    def __init__(self, tokenizer=None, type: str = "del_prob", weight: Optional[float] = None, *,
                 vocab: Optional[NumberVocab] = None, chunk_size: int = 1024, **options):
        super().__init__()
        if type not in LOSS_TYPES:
            raise ValueError(f"unknown loss type {type!r}; choose one of {', '.join(LOSS_TYPES)}")
        if vocab is None and LOSS_TYPES[type].has_term:
            if tokenizer is None:
                raise ValueError("pass a tokenizer or vocab=NumberVocab(...)")
            with callers_words("build DigitLoss(tokenizer, type='ce') (CE alone)"):
                vocab = NumberVocab.from_tokenizer(tokenizer, purpose=f"DigitLoss(type={type!r})")
        self.vocab = vocab
        weight = LOSS_TYPES[type].default_weight if weight is None else float(weight)
        self.loss = Loss(type, weight, vocab, chunk_size=chunk_size, **options)  # unknown options: ValueError

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        """logits [B, T, V] aligned with labels [B, T] -> CE mean + weight x term mean (fp32 scalar)."""
        return full_logits_loss(logits, labels, self.loss)["loss"]

    def sums(self, hidden: Tensor, lm_head: nn.Module, labels: Tensor) -> Sums:
        """One micro-batch's CE and term sums with its counts, from hidden states aligned with ``labels``."""
        return self.loss.sums(hidden, lm_head, labels)


class _DigitLoss(nn.Module):
    """Base: find digit labels, gather their logit columns, average a per-character term. No lambda applied.

    Single-digit tokenizers and number tokens of 1-3 digits (Llama-3) both work: the term is per digit
    character (delft.numbers.tokens); tokenizers that glue digits to other characters are refused with examples.
    """

    def __init__(self, tokenizer, vocab: Optional[NumberVocab], loss_type: str, **params):
        super().__init__()
        if vocab is None:
            if tokenizer is None:
                raise ValueError("pass a tokenizer or vocab=NumberVocab(...)")
            with callers_words("train with CE alone (no digit term)"):
                vocab = NumberVocab.from_tokenizer(tokenizer, purpose=type(self).__name__)
        self.vocab = vocab
        self.loss = Loss(loss_type, 1.0, vocab, **params)

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        """logits [B, T, V] (or [B, T, n]: the number-token columns) aligned with labels [B, T] -> scalar fp32."""
        return term_mean(logits, labels, self.loss)


class DigitEntropyLoss(_DigitLoss):
    """DEL term (without lambda): mean over digit positions x 10 candidates of w * p * BCE."""

    def __init__(self, tokenizer=None, *, vocab: Optional[NumberVocab] = None):
        super().__init__(tokenizer, vocab, "del")


class NumberTokenLoss(_DigitLoss):
    """NTL term (without lambda): kind 'was' (Wasserstein) or 'mse', mean over digit-label positions."""

    def __init__(self, tokenizer=None, kind: str = "was", *, vocab: Optional[NumberVocab] = None):
        if kind not in ("was", "mse"):
            raise ValueError(f"kind must be 'was' or 'mse', not {kind!r}")
        super().__init__(tokenizer, vocab, f"ntl_{kind}")


class Dist2Loss(_DigitLoss):
    """DIST2 term (without alpha): KL(q || p) with q_k proportional to exp(-(k - y)^2 / tau)."""

    def __init__(self, tokenizer=None, tau: float = 1.0, *, vocab: Optional[NumberVocab] = None):
        super().__init__(tokenizer, vocab, "dist2", tau=tau)
