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

from delft.integrations.hf import HIDDEN_KEYS, DigitLossMixin, last_hidden_states


def _sft_trainer():
    from trl import SFTTrainer

    return SFTTrainer


class DigitSFTTrainer(DigitLossMixin, _sft_trainer()):
    """TRL's ``SFTTrainer`` with delft's CE + weight x digit term; TRL's entropy and token accuracy still logged."""

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
            from delft.losses.loss import Sums

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
