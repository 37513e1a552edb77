"""Library misuse said plainly, for the trainers that carry delft's losses (delft.integrations, the GRPO trainer
among them): a model without an output layer, a tokenizer that is not the model's, trainer options
the digit loss would silently replace, a tokenizer refusal in the caller's own words, and labels without a digit.
Each is checked when the trainer is built (the labels: over the first optimizer steps), so nothing fails after
minutes of loading or generation with a bare ``KeyError`` or ``IndexError``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

from delft.errors import UserError
from delft.numbers.tokens import UnfitTokenizer

NO_DIGIT_STEPS = 3  # optimizer steps without one digit label before the warning: a masking mistake, not chance


def _model_name(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "name_or_path", None) or type(model).__name__


def output_layer(model, caller: str):
    """The output layer of ``model`` (under a peft wrapper too); a UserError naming the model when it has none
    (``LlamaModel`` where ``LlamaForCausalLM`` was meant)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    getter = getattr(base, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        kind = type(base).__name__
        meant = kind[: -len("Model")] + "ForCausalLM" if kind.endswith("Model") else "a *ForCausalLM class"
        raise UserError(f"{caller} got {kind} ({_model_name(base)!r}), a model without an output layer, so neither "
                        "CE nor the digit term can be computed from it",
                        fix=f"Load the model with AutoModelForCausalLM.from_pretrained(...) ({meant}), not AutoModel.")
    return head


def _rows(head) -> int | None:
    rows = getattr(head, "out_features", None)
    weight = getattr(head, "weight", None)
    return int(rows) if rows is not None else (int(weight.shape[0]) if getattr(weight, "ndim", 0) == 2 else None)


def check_number_rows(model, vocab, tokenizer, caller: str) -> None:
    """Refuse a tokenizer whose number tokens lie past the model's output rows (another model's tokenizer, or
    tokens added without resizing): the digit term would index rows that do not exist."""
    if vocab is None or model is None:
        return
    rows = _rows(output_layer(model, caller))
    top = max(vocab.ids)
    if rows is not None and top >= rows:
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise UserError(f"{caller}: tokenizer {name!r} writes numbers with token ids up to {top}, but the output layer "
                        f"of model {_model_name(model)!r} has {rows} rows (ids 0..{rows - 1}), so the tokenizer is "
                        "not this model's", fix="Pass the model's own tokenizer as processing_class "
                        "(AutoTokenizer.from_pretrained of the same name), or call model.resize_token_embeddings("
                        "len(tokenizer)) after adding tokens.")


@contextmanager
def callers_words(ce_alone: str) -> Iterator[None]:
    """Re-raise a tokenizer refusal (recipe words: ``loss.type: ce``) with CE alone spelled as the caller spells it."""
    try:
        yield
    except UnfitTokenizer as err:
        raise err.reworded(ce_alone) from None


def check_sft_options(trainer, caller: str) -> None:
    """Refuse the Trainer / TRL options that compute a loss of their own, which the digit loss would replace
    silently. TRL's ``loss_type="dft"`` is applied (delft.integrations.trl), so it is not among them."""
    args = trainer.args
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in (None, "nll", "dft"):
        raise UserError(f"{caller} computes the loss itself and knows loss_type 'nll' and 'dft', not {loss_type!r}",
                        fix='Pass loss_type="nll" (or "dft"), or use the plain trainer for this loss.')
    if (getattr(args, "label_smoothing_factor", 0) or 0) > 0:
        raise UserError(f"{caller} computes CE itself and does not apply label_smoothing_factor "
                        f"{args.label_smoothing_factor}: the run would train without the smoothing it asks for",
                        fix="Set label_smoothing_factor=0, or use the plain trainer for label smoothing.")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise UserError(f"{caller} computes the loss itself (CE + weight x digit term), so the compute_loss_func "
                        "passed to it would never run", fix="Drop compute_loss_func, or use the plain trainer "
                        "with it.")


class NoDigitWatch:
    """Warns once when the first ``NO_DIGIT_STEPS`` optimizer steps have not one digit among their labels while the
    digit term is on: it then trains nothing, and the usual cause is a mask that hides the answers."""

    def __init__(self, caller: str):
        self.caller, self.steps, self.labels, self.input_digits, self.done = caller, 0, 0, 0, False

    def step(self, loss, batches, labels: int, digits: int) -> None:
        """One optimizer step: its micro-batches and its (all-ranks) label and digit counts."""
        if self.done or not loss.has_term or loss.weight <= 0:
            return
        if digits:
            self.done = True
            return
        self.steps, self.labels = self.steps + 1, self.labels + labels
        self.input_digits += sum(loss.count(b["input_ids"]).digits for b in batches if "input_ids" in b)
        if self.steps >= NO_DIGIT_STEPS:
            self.done = True
            warnings.warn(self.message(loss), UserWarning, stacklevel=3)

    def message(self, loss) -> str:
        seen = (f"every label was -100 ({self.labels} label tokens)" if not self.labels else
                f"{self.labels} label tokens, not one of them a digit")
        cause = ("the inputs held " + f"{self.input_digits} digit characters the labels mask out: the answers are "
                 "masked (labels built from the prompt only, or the completion's labels set to -100)"
                 if self.input_digits else "the inputs held no digit either: check that the data has numbers")
        return (f"{self.caller}: the first {self.steps} optimizer steps had {seen}, so the digit term "
                f"({loss.type}, weight {loss.weight:g}) trained nothing; {cause}.")
