"""delft's digit losses inside transformers' ``Trainer``: ``DigitLossMixin`` for any Trainer subclass, and
``DigitTrainer = DigitLossMixin + Trainer``.

    trainer = DigitTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer,
                           digit_loss={"type": "del_prob", "weight": 0.3})

The loss of one optimizer step is delft's: CE summed over every label token of the step / their count + weight x
the digit term summed over every digit character of the step / their count, both counts taken over every
gradient-accumulation micro-batch and every rank before the first backward. The Trainer counts label tokens
(``num_items_in_batch``) but not digits, so ``get_batch_samples`` counts both and all-reduces them. Only the last
hidden states come out of the model (``logits_to_keep`` keeps none), and CE and the term are computed from them
and the output layer in chunks or with Liger's fused kernel (delft.losses), so the full [tokens x vocabulary]
logits never exist. ``digit_loss={"normalisation": "reference", ...}`` reproduces the DEL authors' scaling under
this Trainer instead: the term a mean per micro-batch, x accumulation steps x processes.
"""

from __future__ import annotations

from typing import Optional

from delft.models.loading import last_hidden_states  # noqa: F401  (re-exported: integrations.trl uses it)

HIDDEN_KEYS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "cu_seq_lens_q", "cu_seq_lens_k",
               "max_length_q", "max_length_k", "seq_idx")  # what the forward takes besides the labels


def aligned_labels(inputs: dict):
    """(labels aligned with the hidden states, how many leading hidden positions to drop at the end): the
    collator's ``shift_labels`` as they are, else ``labels[:, 1:]`` against hidden[:, :-1]."""
    if "shift_labels" in inputs:
        return inputs["shift_labels"], 0
    return inputs["labels"][:, 1:], 1


class DigitLossMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class MyTrainer(DigitLossMixin, MyBaseTrainer)``.

    ``digit_loss``: ``{"type": ..., "weight": ..., **options}`` with delft's ``loss:`` recipe keys (type, weight,
    normalisation, place_weights, place_weight_cap, tau); the tokenizer is the Trainer's ``processing_class``.
    Logged beside the Trainer's ``loss``: ``ce`` and ``digit_term`` (each the step's mean, averaged over the
    logged steps) and ``digit_weight``.
    """

    # The loss is already normalised over the whole optimizer batch: the Trainer must not divide it by the
    # accumulation steps (transformers 5's switch for subclasses that compute their own loss).
    loss_is_scaled_for_ga = True

    def __init__(self, *args, digit_loss: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._digit_loss = None
        self._step_counts: Optional[tuple[int, int]] = None  # (labels, digits) of the current optimizer step
        self._logged = None  # [ce, term] means summed over the steps since the last log (this rank's share)
        if digit_loss is not None:  # built now, so a bad option fails before training; else on first use
            self.configure_digit_loss(digit_loss)

    @property
    def digit_loss(self):
        """The delft.losses.DigitLoss in use (del_prob at its default weight unless configured)."""
        if self._digit_loss is None:
            self.configure_digit_loss({})
        return self._digit_loss

    def configure_digit_loss(self, options: dict, tokenizer=None) -> None:
        """(Re)build the digit loss from ``options`` (also how the axolotl plugin hands its YAML block over)."""
        from delft.losses.modules import DigitLoss

        tokenizer = tokenizer or getattr(self, "processing_class", None)
        opts = dict(options)
        self._digit_loss = DigitLoss(tokenizer, opts.pop("type", "del_prob"), **opts)

    # ------------------------------------------------------------------ the step's counts

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        labels = digits = 0
        for batch in batch_samples:
            if "labels" in batch:
                counts = self.digit_loss.loss.count(aligned_labels(batch)[0])
                labels, digits = labels + counts.labels, digits + counts.digits
        self._step_counts = self._all_ranks(labels, digits)
        return batch_samples, num_items

    def _all_ranks(self, labels: int, digits: int) -> tuple[int, int]:
        import torch

        if self.accelerator.num_processes == 1:
            return labels, digits
        t = torch.tensor([labels, digits], dtype=torch.int64, device=self.accelerator.device)
        t = self.accelerator.reduce(t, reduction="sum")
        return int(t[0]), int(t[1])

    # ------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        labels, drop = aligned_labels(inputs)
        sums, outputs = self.digit_sums(model, inputs, labels, drop)
        training = model.training and self._step_counts is not None
        counts = type(sums.counts)(*self._step_counts) if training else sums.counts
        # 'reference': CE per label of the step + weight x this micro-batch's own term mean (Loss.combine)
        value = self.digit_loss.loss.combine(sums, counts)
        if training:
            self._remember(sums, counts)
        # DDP averages the ranks' gradients; the loss is normalised by counts of every rank, so scale it back up
        value = value * self.accelerator.num_processes
        return (value, outputs) if return_outputs else value

    def digit_sums(self, model, inputs: dict, labels, drop: int):
        """(delft.losses.Sums of this micro-batch, the model's outputs): one forward, the last hidden states only."""
        import torch

        with last_hidden_states(self.accelerator.unwrap_model(model)) as (captured, head):  # hooks go on the model,
            outputs = model(**{k: v for k, v in inputs.items() if k in HIDDEN_KEYS}, use_cache=False,  # DDP runs it
                            logits_to_keep=torch.zeros(0, dtype=torch.long, device=labels.device))
        hidden = captured["hidden"]
        hidden = hidden[:, :-1] if drop else hidden
        return self.digit_loss.sums(hidden, head, labels), outputs

    def _remember(self, sums, counts) -> None:
        import torch

        ce = float(sums.ce.detach()) / max(1, counts.labels)
        term = float(sums.term.detach()) / counts.digits if counts.digits else 0.0
        add = torch.tensor([ce, term], dtype=torch.float64)
        self._logged = add if self._logged is None else self._logged + add

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict, *args, **kwargs) -> None:
        if self._logged is not None and "loss" in logs:
            steps = max(1, self.state.global_step - getattr(self, "_last_logged_step", 0))
            total = self._logged.to(self.accelerator.device)
            if self.accelerator.num_processes > 1:
                total = self.accelerator.reduce(total, reduction="sum")
            logs["ce"], logs["digit_term"] = (round(float(v) / steps, 6) for v in total.cpu())
            logs["digit_weight"] = self.digit_loss.loss.weight
            self._logged, self._last_logged_step = None, self.state.global_step
        super().log(logs, *args, **kwargs)


def _trainer():
    from transformers import Trainer

    return Trainer


class DigitTrainer(DigitLossMixin, _trainer()):
    """``transformers.Trainer`` with delft's CE + weight x digit term (see the module docstring)."""
