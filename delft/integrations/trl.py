"""delft's digit losses inside TRL's ``SFTTrainer`` (TRL 1.16): ``DigitSFTTrainer``.

    trainer = DigitSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tokenizer,
                              digit_loss={"type": "del_prob", "weight": 0.3})

One forward serves both terms: TRL's fused LM head (``model(..., fused_lm_head=True)``) gives the per-token
log-probabilities of the labels without building logits, and the same forward's last hidden states (captured from
the decoder) give the digit term from the output layer's number-token rows. So completion-only and packed datasets,
``padding_free`` and ``use_liger_kernel`` (its layer kernels) work as they do in TRL, and TRL's ``compute_loss_func``
(deprecated in 1.16, and a second forward) is not used. Normalisation as ``delft.integrations.hf``. TRL's
``loss_type="dft"`` is applied as TRL applies it (the CE part, logged as ``ce``, is then DFT's); label smoothing and
a ``compute_loss_func`` are refused (delft.losses.misuse).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from delft.integrations.hf import HIDDEN_KEYS, DigitLossMixin
from delft.losses.loss import Sums
from delft.losses.registry import LOSS_TYPES
from delft.models.loading import last_hidden_states
from delft.recipe.schema import LossConfig
from delft.integrations.digit_options import RESUME_MISMATCH, DigitLossValueError, check_resume_mismatch, digit_loss_options

_KEYS = ("type", "weight", "normalisation", "place_weights", "place_weight_cap", "tau")  # DigitSFTConfig's digit_loss_*
_DEFAULTS = {**{k: LossConfig.model_fields[k].default for k in _KEYS}, "type": "del_prob"}


def _sft_trainer():
    from trl import SFTTrainer

    return SFTTrainer


def _sft_config():
    from trl import SFTConfig

    return SFTConfig


def _field(key: str, help: str, **meta):
    return field(default=_DEFAULTS[key], metadata={"help": help, **meta})


@dataclass
class DigitSFTConfig(_sft_config()):
    """TRL's ``SFTConfig`` with the digit loss as fields, so TRL's config files and ``TrlParser`` command lines
    (``--digit_loss_type del --digit_loss_weight 0.5``) choose it; ``DigitSFTTrainer`` reads them from its args."""

    digit_loss_type: str = _field("type", "delft's digit term added to CE (docs/losses.md); 'ce': CE alone.",
                                  choices=list(LOSS_TYPES))
    digit_loss_weight: Optional[float] = _field("weight", "lambda in CE + lambda x the digit term (>= 0); unset: "
                                                "the type's default.")
    digit_loss_normalisation: str = _field("normalisation", "global: CE per label + lambda x term per digit over the "
                                           "optimizer batch; reference: the DEL authors' per-micro-batch scaling.",
                                           choices=list(LossConfig.model_fields["normalisation"].annotation.__args__))
    digit_loss_place_weights: str = _field("place_weights", "DEL types: reference (2r for the r-th integer digit), "
                                           "capped (at digit_loss_place_weight_cap), uniform (1).",
                                           choices=list(LossConfig.model_fields["place_weights"].annotation.__args__))
    digit_loss_place_weight_cap: float = _field("place_weight_cap", "digit_loss_place_weights capped: the largest "
                                                "integer-digit weight.")
    digit_loss_tau: float = _field("tau", "dist2 only: the width of the soft target exp(-(k-y)^2/tau).")
    digit_loss_resume_mismatch: str = field(default="refuse", metadata={
        "help": "A resume whose digit loss differs from the checkpoint's digit_loss.json: refuse, or allow it "
        "(changing the loss on purpose).", "choices": list(RESUME_MISMATCH)})

    def __post_init__(self):
        super().__post_init__()
        check_resume_mismatch(self.digit_loss_resume_mismatch)
        shown = "DigitSFTConfig(" + ", ".join(f"digit_loss_{k}={v!r}" for k, v in self.digit_loss_dict().items()) + ")"
        digit_loss_options(self.digit_loss_dict(), key_prefix="digit_loss_", shown=shown)  # refused at parse time

    def digit_loss_dict(self) -> dict:
        """The ``digit_loss`` these fields give: the type, and every other field set away from its default."""
        values = {k: getattr(self, f"digit_loss_{k}") for k in _KEYS}
        return {k: v for k, v in values.items() if k == "type" or v != _DEFAULTS[k]}


class DigitSFTTrainer(DigitLossMixin, _sft_trainer()):
    """TRL's ``SFTTrainer`` with delft's CE + weight x digit term; TRL's entropy and token accuracy still logged.
    With ``args`` a ``DigitSFTConfig``, its ``digit_loss_*`` fields are the digit loss."""

    def __init__(self, *args, digit_loss=None, digit_loss_resume_mismatch: Optional[str] = None, **kwargs):
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        if isinstance(config, DigitSFTConfig):
            if digit_loss is not None and config.digit_loss_dict() != {"type": _DEFAULTS["type"]}:
                raise DigitLossValueError(
                    f"DigitSFTTrainer got digit_loss={digit_loss!r} and a DigitSFTConfig whose digit_loss_* fields "
                    f"say {config.digit_loss_dict()!r}", fix="Set the digit loss in one place: the config's fields "
                    "or digit_loss=.")
            digit_loss = config.digit_loss_dict() if digit_loss is None else digit_loss
            digit_loss_resume_mismatch = digit_loss_resume_mismatch or config.digit_loss_resume_mismatch
        super().__init__(*args, digit_loss=digit_loss, digit_loss_resume_mismatch=digit_loss_resume_mismatch or "refuse",
                         **kwargs)

    def digit_sums(self, model, inputs: dict, labels, drop: int):
        keys = {k: v for k, v in inputs.items() if k in HIDDEN_KEYS or k in ("labels", "shift_labels")}
        with last_hidden_states(self.accelerator.unwrap_model(model)) as (captured, head):
            outputs = model(**keys, use_cache=False, fused_lm_head=True)
        hidden = captured["hidden"]
        hidden = hidden[:, :-1] if drop else hidden
        loss = self.digit_loss.loss
        log_probs = outputs.log_probs.float()  # zero on ignored positions
        if getattr(self.args, "loss_type", "nll") == "dft":  # TRL's DFT (arXiv 2508.05629): CE x detached p
            log_probs = log_probs * log_probs.exp().detach()
        ce_sum = -log_probs.sum()
        counts = loss.count(labels)
        if not loss.has_term:
            sums = Sums(ce_sum, ce_sum.new_zeros(()), counts)
        else:
            term_sum, z, y = loss.term_sums(hidden, head, labels)
            sums = loss.micro_sums(ce_sum, term_sum, counts, z, y)
        self._trl_metrics(outputs)
        return sums, outputs

    def _trl_metrics(self, outputs) -> None:
        """TRL's own per-step metrics (entropy, mean token accuracy), which its compute_loss would have logged."""
        mode = "train" if self.model.training else "eval"
        valid = self.accelerator.gather_for_metrics(outputs.label_mask.sum()).sum()
        for name, field in (("entropy", "entropy"), ("mean_token_accuracy", "is_top1")):
            values = getattr(outputs, field, None)
            if values is not None:
                total = self.accelerator.gather_for_metrics(values.detach().float().sum()).sum()
                self._metrics[mode][name].append(float(total / valid) if valid > 0 else 0.0)
