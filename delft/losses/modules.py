"""The full-logits path and the standalone ``nn.Module`` losses (``DigitEntropyLoss``, ``NumberTokenLoss``,
``Dist2Loss``) for code that already has logits [B, T, V] aligned with its labels.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from delft.losses.loss import Loss, Sums
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
    ce_sum = F.cross_entropy(flat.to(compute_dtype(flat.dtype)), labels.reshape(-1), ignore_index=IGNORE,
                             reduction="sum")
    counts = loss.count(labels)
    if not loss.has_term:
        return loss.means(Sums(ce_sum, torch.zeros_like(ce_sum), counts), counts)
    term_sum, z, y = _term_sum(logits, labels, loss)
    return loss.means(loss.micro_sums(ce_sum, term_sum, counts, z, y), counts)


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
