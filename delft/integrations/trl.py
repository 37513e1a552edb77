"""delft's digit losses inside TRL's ``SFTTrainer`` (TRL 1.16): ``DigitSFTTrainer``.

    trainer = DigitSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tokenizer,
                              digit_loss={"type": "del_prob", "weight": 0.3})

One forward serves both terms: TRL's fused LM head (``model(..., fused_lm_head=True)``) gives the per-token
log-probabilities of the labels without building logits, and the same forward's last hidden states (captured from
the decoder) give the digit term from the output layer's number-token rows. So completion-only and packed datasets,
``padding_free`` and ``use_liger_kernel`` (its layer kernels) work as they do in TRL, and TRL's ``compute_loss_func``
(deprecated in 1.16, and a second forward) is not used. Normalisation as ``delft.integrations.hf``. TRL's
``loss_type="dft"`` is applied as TRL applies it (the CE part, logged as ``ce``, is then DFT's); label smoothing and
a ``compute_loss_func`` are refused (delft.losses.misuse). What TRL's SFTTrainer logs and hands on is kept: its
entropy, token accuracy and ``num_tokens``, a mixture of experts' router loss (added and logged as ``aux_loss`` as
TRL does), and the logits ``compute_metrics`` reads (a second forward, as TRL's).

``DigitSFTConfig`` is TRL's ``SFTConfig`` with the digit loss as fields (delft.integrations.digit_options.
DigitLossFields); TRL's own ``SFTTrainer`` given one is refused, since it would train without the digit loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from delft.integrations.digit_options import DigitLossFields, config_digit_loss, digit_trainer_building
from delft.integrations.hf import HIDDEN_KEYS, DigitLossMixin
from delft.losses.loss import Sums
from delft.models.loading import last_hidden_states


def _sft_trainer():
    from trl import SFTTrainer

    return SFTTrainer


def _sft_config():
    from trl import SFTConfig

    return SFTConfig


@dataclass
class DigitSFTConfig(DigitLossFields, _sft_config()):
    """TRL's ``SFTConfig`` with the digit loss as fields, so TRL's config files and ``TrlParser`` command lines
    (``--digit_loss_type del --digit_loss_weight 0.5``) choose it; ``DigitSFTTrainer`` reads them from its args, and
    any other trainer given one is refused (it would train without the digit loss)."""


class DigitSFTTrainer(DigitLossMixin, _sft_trainer()):
    """TRL's ``SFTTrainer`` with delft's CE + weight x digit term; TRL's entropy, token accuracy, ``num_tokens`` and
    a router's ``aux_loss`` still logged. With ``args`` a ``DigitSFTConfig``, its ``digit_loss_*`` fields are the
    digit loss."""

    _logs_aux_itself = True

    def __init__(self, *args, digit_loss=None, digit_loss_resume_mismatch: Optional[str] = None, **kwargs):
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        digit_loss, mismatch = config_digit_loss(config, digit_loss, digit_loss_resume_mismatch, "DigitSFTTrainer")
        with digit_trainer_building(config):
            super().__init__(*args, digit_loss=digit_loss, digit_loss_resume_mismatch=mismatch, **kwargs)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if not return_outputs:
            return loss
        # TRL's prediction_step asks for the outputs only when compute_metrics reads the logits; the fused head
        # built none, so they come from a second forward, as TRL's SFTTrainer makes them
        with torch.no_grad():
            outputs = model(**self._forward_keys({k: v for k, v in inputs.items() if k != "labels"}))
        return loss, outputs

    def _forward_keys(self, inputs: dict) -> dict:
        """``inputs`` with what TRL's compute_loss adds: no cache, and the router logits of a mixture of experts."""
        extra = {"output_router_logits": True} if getattr(self, "aux_loss_enabled", False) else {}
        return {**inputs, "use_cache": False, **extra}

    def digit_sums(self, model, inputs: dict, labels, drop: int):
        keys = {k: v for k, v in inputs.items() if k in HIDDEN_KEYS or k in ("labels", "shift_labels")}
        with last_hidden_states(self.accelerator.unwrap_model(model)) as (captured, head):
            outputs = model(**self._forward_keys(keys), fused_lm_head=True)
        hidden = captured["hidden"]
        hidden = hidden[:, :-1] if drop else hidden
        loss = self.digit_loss.loss
        log_probs = outputs.log_probs.float()  # zero on ignored positions
        # DFT (arXiv 2508.05629), TRL's loss_type or delft's type: each label's CE x its detached probability
        if getattr(self.args, "loss_type", "nll") == "dft" or loss.kind.replaces_ce:
            log_probs = log_probs * log_probs.exp().detach()
        ce_sum = -log_probs.sum()
        counts = loss.count(labels)
        if not loss.has_term:
            sums = Sums(ce_sum, ce_sum.new_zeros(()), counts)
        else:
            term_sum, z, y = loss.term_sums(hidden, head, labels)
            sums = loss.micro_sums(ce_sum, term_sum, counts, z, y)
        self._trl_metrics(inputs, outputs)
        return sums, outputs

    def router_loss(self, outputs):
        """The router loss TRL's SFTTrainer adds: when it enabled it (``aux_loss_enabled``, from the model's
        config and SFTConfig's ``router_aux_loss_coef``)."""
        return super().router_loss(outputs) if getattr(self, "aux_loss_enabled", False) else None

    def router_weight(self) -> float:
        return float(self.router_aux_loss_coef)

    def _trl_metrics(self, inputs: dict, outputs) -> None:
        """TRL's own metrics, which its compute_loss would have logged: entropy, mean token accuracy, the tokens
        trained on so far (``num_tokens``) and a mixture of experts' ``aux_loss``."""
        mode = "train" if self.model.training else "eval"
        valid = self.accelerator.gather_for_metrics(outputs.label_mask.sum()).sum()
        for name, field in (("entropy", "entropy"), ("mean_token_accuracy", "is_top1")):
            values = getattr(outputs, field, None)
            if values is not None:
                total = self.accelerator.gather_for_metrics(values.detach().float().sum()).sum()
                self._metrics[mode][name].append(float(total / valid) if valid > 0 else 0.0)
        if mode == "train":  # TRL counts the attention mask, or the packed row's length when padding-free
            if "attention_mask" in inputs:
                tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            else:
                ids = inputs["position_ids"]
                tokens = self.accelerator.gather_for_metrics(torch.tensor(ids.size(1), device=ids.device)).sum().item()
            self._total_train_tokens += tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if getattr(self, "aux_loss_enabled", False):
            aux = self.accelerator.gather_for_metrics(outputs.aux_loss.detach()).mean().item()
            self._metrics[mode]["aux_loss"].append(aux)
