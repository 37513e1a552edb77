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

What the plain Trainer gives its users still works: a mixture-of-experts model's router loss (the model's
``aux_loss`` x its ``router_aux_loss_coef``, a mean per micro-batch averaged over the step's micro-batches, as TRL
adds it) is added and logged as ``aux_loss``; ``compute_metrics`` and ``preprocess_logits_for_metrics`` get the
full logits the plain Trainer hands them (one forward that builds them, during evaluation only); ``eval_ce`` and
``eval_digit_term`` weigh the eval batches by their rows as ``eval_loss`` does.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from delft.integrations.digit_options import (NUMBERS_KEY, DigitLossValueError, check_resume, check_resume_mismatch,
                                             digit_loss_options, save_settings)
from delft.losses.misuse import NoDigitWatch, callers_words, check_number_rows, check_sft_options, output_layer
from delft.losses.modules import DigitLoss
from delft.losses.registry import LOSS_TYPES
from delft.models.loading import last_hidden_states  # noqa: F401  (re-exported: integrations.trl uses it)
from delft.numbers.tokens import NumberVocab
from delft.recipe.schema import NumbersConfig

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
    normalisation, place_weights, place_weight_cap, tau) and ``numbers`` (the form the data writes numbers in:
    ``{"order": "reversed", "count_prefix": True}``), or a type's name; checked by delft.integrations.digit_options
    (in the caller's words). The tokenizer is the Trainer's ``processing_class``. Logged beside the Trainer's
    ``loss``: ``ce`` and ``digit_term`` (each the step's mean, averaged over the logged steps) and ``digit_weight``
    (neither term nor weight for ``type: ce``), ``aux_loss`` for a mixture-of-experts model; ``evaluate()``
    reports ``eval_ce``, ``eval_digit_term`` (and ``eval_aux_loss``) beside ``eval_loss``, each weighed over the
    eval batches as ``eval_loss`` is. Each checkpoint holds the settings in ``digit_loss.json``; resuming from one
    with other settings is refused unless ``digit_loss_resume_mismatch="allow"``.
    """

    # The loss is already normalised over the whole optimizer batch: the Trainer must not divide it by the
    # accumulation steps (transformers 5's switch for subclasses that compute their own loss).
    loss_is_scaled_for_ga = True
    _logs_aux_itself = False  # DigitSFTTrainer: TRL's metrics log the router loss as TRL's SFTTrainer does

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
        self._logged = None  # [ce, term, aux] means summed over the steps since the last log (this rank's share)
        self._logged_from = 0  # the global step before the first step in _logged (a resume starts past 0)
        self._eval_rows = None  # per eval batch [loss, ce, term, aux] x its rows, gathered as the loop gathers losses
        self._logits_wanted = False  # set by prediction_step when compute_metrics needs the logits
        self._aux_seen = False  # the model returned a router loss (logged as aux_loss from then on)
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
        self._digit_loss = build_digit_loss(tokenizer, opts, type(self).__name__)
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
        if training:  # DDP averages the ranks' gradients; the loss is normalised by every rank's counts: scale up
            value = value * self.accelerator.num_processes
        aux = self.router_loss(outputs)
        # a router loss is a mean per micro-batch, which DDP averages over the ranks: the step averages it over
        # its micro-batches (as TRL's SFTTrainer does), so it does not grow with the accumulation steps
        share = 1 / getattr(self, "current_gradient_accumulation_steps", 1) if training else 1.0
        if aux is not None:
            value = value + self.router_weight() * aux * share
        if training:
            self._remember(sums, counts, None if aux is None else float(aux.detach()) * share)
        elif self._eval_rows is not None:
            self._eval_row(inputs, value, sums, aux)
        return (value, outputs) if return_outputs else value

    def digit_sums(self, model, inputs: dict, labels, drop: int):
        """(delft.losses.Sums of this micro-batch, the model's outputs): one forward, the last hidden states only
        (the full logits as well when ``compute_metrics`` needs them)."""
        keep = {} if self._logits_wanted and not model.training else {
            "logits_to_keep": torch.zeros(0, dtype=torch.long, device=labels.device)}
        with last_hidden_states(self.accelerator.unwrap_model(model)) as (captured, head):  # hooks go on the model,
            outputs = model(**{k: v for k, v in inputs.items() if k in HIDDEN_KEYS}, use_cache=False, **keep)  # DDP
        hidden = captured["hidden"]  # runs it
        hidden = hidden[:, :-1] if drop else hidden
        return self.digit_sums_from(hidden, head, labels), outputs

    def digit_sums_from(self, hidden, head, labels):
        """CE and the term of the hidden states ``hidden`` (aligned with ``labels``) through the output layer."""
        return self.digit_loss.sums(hidden, head, labels)

    # ------------------------------------------------------------------ a mixture of experts' router loss

    def router_loss(self, outputs):
        """The model's own auxiliary loss (a mixture of experts' load balancing), or None: the model returns one
        when its config says ``output_router_logits``, as the plain Trainer's loss would include it."""
        aux = getattr(outputs, "aux_loss", None)
        if aux is None:
            return None
        self._aux_seen = True
        return aux

    def router_weight(self) -> float:
        """The coefficient the model's own loss puts on its ``aux_loss``: the model's ``router_aux_loss_coef``."""
        model = self.accelerator.unwrap_model(self.model)
        coef = getattr(model, "router_aux_loss_coef", None)
        if coef is None:
            config = getattr(model, "config", None)
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            coef = getattr(text, "router_aux_loss_coef", None)
        if coef is None:
            raise DigitLossValueError(
                f"{type(self).__name__}: {type(model).__name__} returns an auxiliary loss (aux_loss) but has no "
                "router_aux_loss_coef to weigh it with, so its share of the loss is unknown",
                fix="Set router_aux_loss_coef in the model's config, or output_router_logits=False to train "
                "without the auxiliary loss.")
        return float(coef)

    # ------------------------------------------------------------------ logging

    @staticmethod
    def _means(sums, counts) -> tuple[float, float]:
        """(CE per label, the term per digit character) of ``sums`` over ``counts``."""
        ce = float(sums.ce.detach()) / max(1, counts.labels)
        return ce, float(sums.term.detach()) / counts.digits if counts.digits else 0.0

    def _remember(self, sums, counts, aux: Optional[float]) -> None:
        if self._logged is None:  # the first step since the last log (or since a resume): count steps from here
            self._logged_from = self.state.global_step
        add = torch.tensor([*self._means(sums, counts), aux or 0.0], dtype=torch.float64)
        self._logged = add if self._logged is None else self._logged + add

    def _sum_ranks(self, values: list[float]) -> list[float]:
        if self.accelerator.num_processes == 1:
            return values
        total = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return [float(v) for v in self.accelerator.reduce(total, reduction="sum").cpu()]

    def _parts(self, prefix: str, ce: float, term: float, aux: float) -> dict:
        """The logged parts of the loss under their names: no term nor weight for a loss without one (``ce``)."""
        out = {f"{prefix}ce": ce}
        if self.digit_loss.loss.has_term:
            out[f"{prefix}digit_term"] = term
            if not prefix:
                out["digit_weight"] = self.digit_loss.loss.weight
        if self._aux_seen and not self._logs_aux_itself:
            out[f"{prefix}aux_loss"] = aux
        return out

    def log(self, logs: dict, *args, **kwargs) -> None:
        if self._logged is not None and "loss" in logs:
            # the Trainer divides its loss by the steps since its last log (or since the resume), so do the same;
            # the ranks' sums over their number: each rank's step means are already normalised over every rank
            steps = max(1, self.state.global_step - self._logged_from)
            ce, term, aux = self._sum_ranks([float(v) for v in self._logged])
            aux /= self.accelerator.num_processes  # a rank's own mean: averaged over the ranks, as DDP does
            logs.update({k: round(v / steps, 6) if k != "digit_weight" else v
                         for k, v in self._parts("", ce, term, aux).items()})
            self._logged = None
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ evaluation

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's step; the forward builds the full logits only when the Trainer hands them on (to
        ``compute_metrics`` or ``preprocess_logits_for_metrics``, or ``predict``)."""
        self._logits_wanted = not prediction_loss_only
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._logits_wanted = False

    def _eval_row(self, inputs: dict, value, sums, aux) -> None:
        """This batch's loss and parts, repeated and gathered as the evaluation loop gathers its losses (the eval
        batch size times, the duplicates of a last, uneven batch dropped), so each part is weighed as eval_loss."""
        from transformers.trainer_pt_utils import find_batch_size

        ce, term = self._means(sums, sums.counts)
        row = torch.tensor([float(value.detach()), ce, term, 0.0 if aux is None else float(aux.detach())],
                           dtype=torch.float64, device=self.accelerator.device)
        rows = self.args.eval_batch_size or find_batch_size(inputs)
        self._eval_rows.append(self.gather_function(row.repeat(rows, 1)).cpu())

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop, with ``<prefix>_ce`` and ``<prefix>_digit_term`` (and ``<prefix>_aux_loss``) beside
        ``<prefix>_loss``, each weighed over the batches (and ranks) as the Trainer weighs the loss."""
        self._eval_rows = []
        try:
            output = super().evaluation_loop(*args, **kwargs)
            rows = torch.cat(self._eval_rows) if self._eval_rows else None
        finally:
            self._eval_rows = None
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        if rows is not None and len(rows) and f"{prefix}_loss" in output.metrics:
            finite = torch.isfinite(rows[:, 0])
            if self.args.logging_nan_inf_filter and finite.any():  # the rows the Trainer keeps for eval_loss
                rows = rows[finite]
            ce, term, aux = (float(v) for v in rows[:, 1:].mean(0))
            output.metrics.update(self._parts(f"{prefix}_", ce, term, aux))
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
        checkpoint = resumed_checkpoint(self, resume_from_checkpoint)
        if checkpoint is not None:
            self.digit_loss  # noqa: B018
            check_resume(checkpoint, self._digit_options, self.digit_loss_resume_mismatch)
        return super().train(resume_from_checkpoint, *args, **kwargs)


def resumed_checkpoint(trainer, resume_from_checkpoint):
    """The checkpoint folder ``train(resume_from_checkpoint=...)`` resumes from (True: the output dir's last), or
    None; none there for True: the Trainer says so itself."""
    from transformers.trainer_utils import get_last_checkpoint

    checkpoint = resume_from_checkpoint
    if checkpoint is True:
        out = trainer.args.output_dir
        checkpoint = get_last_checkpoint(out) if out and os.path.isdir(out) else None
    return None if checkpoint in (None, False) else checkpoint


def build_digit_loss(tokenizer, opts: dict, caller: str) -> DigitLoss:
    """The DigitLoss of checked ``opts`` (digit_loss_options) for a trainer named ``caller``: the number tokens
    found with ``tokenizer`` (the trainer's processing_class), read in the ``numbers`` form the options give."""
    opts = dict(opts)
    form = opts.pop(NUMBERS_KEY, None)
    kind = opts.pop("type", "del_prob")
    with callers_words(f'pass digit_loss={{"type": "ce"}} to {caller} (CE alone)'):
        vocab = None
        if LOSS_TYPES[kind].has_term:
            if tokenizer is None:
                raise DigitLossValueError(
                    f"{caller} has no tokenizer to find the number tokens with: its processing_class is None, and "
                    f"digit_loss type {kind!r} reads digits", fix=f"Pass processing_class=tokenizer to {caller} "
                    '(the model\'s tokenizer), or digit_loss={"type": "ce"} to train CE alone.')
            vocab = NumberVocab.from_tokenizer(tokenizer, purpose=f"DigitLoss(type={kind!r})")
            if form:
                vocab = vocab.written_as(NumbersConfig(**form))
        return DigitLoss(tokenizer, kind, vocab=vocab, **opts)


def _trainer():
    from transformers import Trainer

    return Trainer


class DigitTrainer(DigitLossMixin, _trainer()):
    """``transformers.Trainer`` with delft's CE + weight x digit term (see the module docstring)."""
