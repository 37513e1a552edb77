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

import os
from typing import Optional

from delft.losses.misuse import NoDigitWatch, callers_words, check_number_rows, check_sft_options, output_layer
from delft.losses.modules import DigitLoss
from delft.models.loading import last_hidden_states  # noqa: F401  (re-exported: integrations.trl uses it)
from delft.integrations.digit_options import check_resume, check_resume_mismatch, digit_loss_options, save_settings

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
    normalisation, place_weights, place_weight_cap, tau), or a type's name; checked by
    delft.integrations.digit_options (in the caller's words). The tokenizer is the Trainer's ``processing_class``.
    Logged beside the Trainer's ``loss``: ``ce`` and ``digit_term`` (each the step's mean, averaged over the
    logged steps) and ``digit_weight``; ``evaluate()`` reports ``eval_ce`` and ``eval_digit_term`` beside
    ``eval_loss`` (averaged over the eval batches as ``eval_loss`` is). Each checkpoint holds the settings in
    ``digit_loss.json``; resuming from one with other settings is refused unless
    ``digit_loss_resume_mismatch="allow"``.
    """

    # The loss is already normalised over the whole optimizer batch: the Trainer must not divide it by the
    # accumulation steps (transformers 5's switch for subclasses that compute their own loss).
    loss_is_scaled_for_ga = True

    def __init__(self, *args, digit_loss: Optional[dict | str] = None, digit_loss_resume_mismatch: str = "refuse",
                 **kwargs):
        if digit_loss is not None:  # checked before the Trainer loads anything
            digit_loss = digit_loss_options(digit_loss)
        self.digit_loss_resume_mismatch = check_resume_mismatch(digit_loss_resume_mismatch)
        super().__init__(*args, **kwargs)
        check_sft_options(self, type(self).__name__)  # what the Trainer's own loss would have applied
        if self.model is not None:
            output_layer(self.model, type(self).__name__)
        self._digit_watch = NoDigitWatch(type(self).__name__)
        self._digit_loss = None
        self._step_counts: Optional[tuple[int, int]] = None  # (labels, digits) of the current optimizer step
        self._logged = None  # [ce, term] means summed over the steps since the last log (this rank's share)
        self._logged_from = 0  # the global step before the first step in _logged (a resume starts past 0)
        self._eval_parts = None  # [ce, term, batches] summed over an evaluation loop's batches (this rank's)
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
        tokenizer = tokenizer or getattr(self, "processing_class", None)
        opts = digit_loss_options(options)
        self._digit_options = dict(opts)  # what digit_loss.json records with each checkpoint
        with callers_words(f'pass digit_loss={{"type": "ce"}} to {type(self).__name__} (CE alone)'):
            self._digit_loss = DigitLoss(tokenizer, opts.pop("type", "del_prob"), **opts)
        check_number_rows(self.model, self._digit_loss.vocab, tokenizer, type(self).__name__)

    # ------------------------------------------------------------------ the step's counts

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        labels = digits = 0
        for batch in batch_samples:
            if "labels" in batch:
                counts = self.digit_loss.loss.count(aligned_labels(batch)[0])
                labels, digits = labels + counts.labels, digits + counts.digits
        self._step_counts = self._all_ranks(labels, digits)
        self._digit_watch.step(self.digit_loss.loss, batch_samples, *self._step_counts)  # warns once: no digit
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
        elif self._eval_parts is not None:
            ce, term = self._means(sums, sums.counts)
            self._eval_parts = [a + b for a, b in zip(self._eval_parts, (ce, term, 1))]
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

    @staticmethod
    def _means(sums, counts) -> tuple[float, float]:
        """(CE per label, the term per digit character) of ``sums`` over ``counts``."""
        ce = float(sums.ce.detach()) / max(1, counts.labels)
        return ce, float(sums.term.detach()) / counts.digits if counts.digits else 0.0

    def _remember(self, sums, counts) -> None:
        import torch

        if self._logged is None:  # the first step since the last log (or since a resume): count steps from here
            self._logged_from = self.state.global_step
        add = torch.tensor(self._means(sums, counts), dtype=torch.float64)
        self._logged = add if self._logged is None else self._logged + add

    def _sum_ranks(self, values: list[float]) -> list[float]:
        import torch

        if self.accelerator.num_processes == 1:
            return values
        total = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return [float(v) for v in self.accelerator.reduce(total, reduction="sum").cpu()]

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict, *args, **kwargs) -> None:
        if self._logged is not None and "loss" in logs:
            # the Trainer divides its loss by the steps since its last log (or since the resume), so do the same
            steps = max(1, self.state.global_step - self._logged_from)
            total = self._sum_ranks([float(v) for v in self._logged])
            logs["ce"], logs["digit_term"] = (round(v / steps, 6) for v in total)
            logs["digit_weight"] = self.digit_loss.loss.weight
            self._logged = None
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop, with ``<prefix>_ce`` and ``<prefix>_digit_term`` beside ``<prefix>_loss``: each batch's
        mean averaged over the batches (and ranks), as the Trainer averages the loss."""
        self._eval_parts = [0.0, 0.0, 0]
        try:
            output = super().evaluation_loop(*args, **kwargs)
            ce, term, batches = self._sum_ranks(self._eval_parts)
        finally:
            self._eval_parts = None
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        if batches and f"{prefix}_loss" in output.metrics:
            output.metrics[f"{prefix}_ce"], output.metrics[f"{prefix}_digit_term"] = ce / batches, term / batches
        return output

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, model, trial) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            self.digit_loss  # noqa: B018  (configures the default loss if none was given)
            save_settings(folder, self._digit_options)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's ``train``, refusing (before anything loads) a checkpoint whose ``digit_loss.json``
        differs from this trainer's digit loss, unless ``digit_loss_resume_mismatch="allow"``."""
        from transformers.trainer_utils import get_last_checkpoint

        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            out = self.args.output_dir  # none there: the Trainer says so itself
            checkpoint = get_last_checkpoint(out) if out and os.path.isdir(out) else None
        if checkpoint not in (None, False):
            self.digit_loss  # noqa: B018
            check_resume(checkpoint, self._digit_options, self.digit_loss_resume_mismatch)
        return super().train(resume_from_checkpoint, *args, **kwargs)


def _trainer():
    from transformers import Trainer

    return Trainer


class DigitTrainer(DigitLossMixin, _trainer()):
    """``transformers.Trainer`` with delft's CE + weight x digit term (see the module docstring)."""
