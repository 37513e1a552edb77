"""One optimizer step: counts over the whole optimizer batch (every micro-batch, every rank) first, then the
micro-batches' backward passes normalised by them; and the validation loss with the same normalisation.
"""

from __future__ import annotations

import torch

from delft.data.batches import collate
from delft.losses.loss import Counts, Sums
from delft.models.loading import check_nf4_exact, decoder_and_head
from delft.training import distributed as dist


def targets(batch: dict):
    """The labels aligned with the decoder's hidden states: position t predicts token t + 1."""
    return batch["labels"][:, 1:]


def forward_sums(model, batch: dict, loss):
    """Hidden states from the decoder, then ``loss.sums`` (CE and digit-term sums, see delft.losses)."""
    decoder, head = decoder_and_head(model)
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    hidden = decoder(input_ids=batch["input_ids"], use_cache=False, **kwargs).last_hidden_state
    return loss.sums(hidden[:, :-1], head, targets(batch))


def micro_sums(model, batch: dict, loss):
    """A micro-batch's Sums: ``forward_sums`` of a model, or the forward of a sharded run's root
    (delft.training.sharding.LossStep, which runs ``forward_sums`` inside FSDP's hooks)."""
    if getattr(model, "computes_loss", False):
        return model(batch)[-1]
    return forward_sums(model, batch, loss)


def optimizer_step(model, batches: list[dict], loss, device: str) -> dict:
    """Backward over the micro-batches, normalised by the whole optimizer batch's counts; returns the step's
    loss, CE and term (``Loss.means``), its real tokens and digit labels. ``model``: as ``micro_sums`` takes it."""
    counts = dist.all_reduce_counts(sum((loss.count(targets(b)) for b in batches), Counts(0, 0)))
    total = Sums(0.0, 0.0, Counts(0, 0))
    for b in batches:
        sums = micro_sums(model, {k: v.to(device) for k, v in b.items()}, loss)
        loss.combine(sums, counts).backward()
        total = total + sums.detach()
    tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in batches)
    total, tokens = dist.global_sums(total, tokens)  # all ranks' batches (one process: unchanged)
    return {**loss.means(total, counts), "tokens": tokens, "n_digits": counts.digits}


def evaluate_loss(model, val, loss, batch_size: int, pad_id: int, device: str) -> dict:
    """Validation loss, CE and term, each normalised over the whole validation set (``model`` as ``micro_sums``
    takes it)."""
    model.eval()
    total = Sums(0.0, 0.0, Counts(0, 0))
    with torch.no_grad():
        for i in range(0, len(val), batch_size):
            b = {k: v.to(device) for k, v in collate(val[i:i + batch_size], pad_id).items()}
            total = total + micro_sums(model, b, loss).detach()
    model.train()
    check_nf4_exact(model)  # eval mode without gradients is when bitsandbytes would repack an nf4 layer
    m = loss.means(total, total.counts)
    return {"val_ce": m["ce"], "val_term": m["term"], "val_loss": m["loss"]}
