"""GRPO with a digit-aware auxiliary term, on TRL's ``GRPOTrainer`` (TRL 1.16): ``DigitGRPOTrainer`` (``delft train``
runs it with ``train.stage: grpo``, delft.training.grpo), the numeric rewards as TRL reward functions
(delft.numbers.rewards), and ``add_gold_columns``, which gives a dataset of TRL's ``prompt`` / ``completion`` rows
the gold token ids the auxiliary term reads.

    from delft.integrations.grpo import DigitGRPOTrainer, add_gold_columns, exact_reward, digit_reward

    trainer = DigitGRPOTrainer(model=model, args=GRPOConfig(...), train_dataset=ds, processing_class=tokenizer,
                               reward_funcs=[exact_reward], digit_loss={"type": "del_prob", "weight": 0.3},
                               aux_mu=0.9, aux_mu_end=0.05)

loss = TRL's GRPO loss on the sampled completions + mu x (CE + weight x digit term) on the teacher-forced gold
solutions of the same prompts (CHORD, arXiv 2508.11408, mixes SFT into RL this way, mu decaying from 0.9 to 0.05).
The gold solutions stay out of the sampled group: inside it, clipped importance ratios would make an off-policy
gold answer contribute almost nothing (the reason huggingface/trl#2680 was closed). The auxiliary term is delft's
SFT loss: CE per gold label token + weight x the term per gold digit character, both counts taken over the whole
gold batch of the optimizer step (every micro-step, every rank), so it does not depend on how the batch is split.

Each dataset row carries the gold as token ids, ``gold_input_ids`` and ``gold_labels`` (prompt masked with -100:
``add_gold_columns`` builds them from TRL's prompt/completion columns; ``delft train`` from its recipe's data);
``answer`` (or a reward's ``answer_column``) is the gold number the rewards read. Rows without what the term or the
rewards read are refused at construction. With mu = 0 throughout, the trainer is TRL's ``GRPOTrainer`` unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from delft.data.batches import Tokenized, collate
from delft.errors import UserError
from delft.integrations.digit_options import (DigitLossFields, DigitLossValueError, check_mu, check_resume,
                                             check_resume_mismatch, config_digit_loss, digit_loss_options,
                                             digit_trainer_building, save_settings)
from delft.integrations.hf import build_digit_loss, resumed_checkpoint
from delft.losses.misuse import check_number_rows, output_layer
from delft.losses.registry import LOSS_TYPES
from delft.models.loading import last_hidden_states
from delft.numbers.rewards import answer_column_of, digit_reward, exact_reward
from delft.numbers.tokens import IGNORE

__all__ = ["DigitGRPOConfig", "DigitGRPOTrainer", "add_gold_columns", "digit_reward", "exact_reward", "gold_ids", "mu_at"]

GOLD_COLUMNS = ("gold_input_ids", "gold_labels")


def _grpo_trainer():
    from trl import GRPOTrainer

    return GRPOTrainer


def _grpo_config():
    from trl import GRPOConfig

    return GRPOConfig


@dataclass
class DigitGRPOConfig(DigitLossFields, _grpo_config()):
    """TRL's ``GRPOConfig`` with the auxiliary term as fields (``--aux_mu 0.9 --aux_mu_end 0.05 --digit_loss_type
    del_prob``), for TRL's config files and ``TrlParser``; ``DigitGRPOTrainer`` reads them from its args, and any
    other trainer given one is refused (it would train without the auxiliary term)."""

    digit_loss_type: str = field(default="ce", metadata={
        "help": "The auxiliary term's loss on the gold solutions: CE ('ce') or CE + weight x a digit term "
        "(docs/losses.md).", "choices": list(LOSS_TYPES)})
    aux_mu: float = field(default=0.0, metadata={"help": "mu of the auxiliary term (0: GRPO alone)."})
    aux_mu_end: Optional[float] = field(default=None, metadata={
        "help": "Decay mu linearly to this by the last step (CHORD: 0.9 to 0.05); unset: mu throughout."})

    _digit_trainer = "DigitGRPOTrainer"
    _DEFAULT_TYPE = "ce"

    def __post_init__(self):
        super().__post_init__()
        check_mu(aux_mu=self.aux_mu, aux_mu_end=self.aux_mu_end)


def _aux_from_config(config, aux_mu, aux_mu_end) -> tuple[float, Optional[float]]:
    """(aux_mu, aux_mu_end): the arguments, or a DigitGRPOConfig's fields; both set is refused."""
    if not isinstance(config, DigitGRPOConfig):
        return (0.0 if aux_mu is None else aux_mu), aux_mu_end
    given = {k: v for k, v in (("aux_mu", aux_mu), ("aux_mu_end", aux_mu_end)) if v is not None}
    if given and (config.aux_mu != 0.0 or config.aux_mu_end is not None):
        raise DigitLossValueError(
            f"DigitGRPOTrainer got {', '.join(f'{k}={v!r}' for k, v in given.items())} and a DigitGRPOConfig whose "
            f"fields say aux_mu={config.aux_mu!r}, aux_mu_end={config.aux_mu_end!r}",
            fix="Set the auxiliary weight in one place: the config's fields or the trainer's arguments.")
    if given:
        return given.get("aux_mu", 0.0), given.get("aux_mu_end")
    return config.aux_mu, config.aux_mu_end


@dataclass
class GoldBatch:
    """One generation batch's gold solutions, split into the micro-steps that consume that batch."""

    parts: list  # collated {input_ids, attention_mask, labels} per micro-step (None for an empty part)
    counts: Any  # delft.losses.loss.Counts over the whole gold batch (every part, every rank)


def mu_at(step: int, total: int, mu: float, mu_end: Optional[float]) -> float:
    """The auxiliary weight at optimizer ``step`` of ``total``: ``mu`` throughout, or linear from ``mu`` to
    ``mu_end`` over the run."""
    if mu_end is None or total <= 1:
        return mu
    return mu + (mu_end - mu) * min(1.0, step / (total - 1))


_COLUMNS_FIX = ("Build the gold columns from TRL's prompt/completion columns with delft.integrations.grpo."
                "add_gold_columns(dataset, tokenizer), or pass aux_mu=0 (GRPO alone); for delft's rewards, add the "
                "answer column or read another: functools.partial(exact_reward, answer_column=...).")


class DigitGRPOTrainer(_grpo_trainer()):
    """TRL's ``GRPOTrainer`` plus mu x delft's SFT loss on the gold solutions (see the module docstring)."""

    def __init__(self, *args, digit_loss: Optional[dict] = None, aux_mu: Optional[float] = None,
                 aux_mu_end: Optional[float] = None, digit_loss_resume_mismatch: Optional[str] = None, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)  # GRPOTrainer(model, reward_funcs, args)
        digit_loss, mismatch = config_digit_loss(config, digit_loss, digit_loss_resume_mismatch, "DigitGRPOTrainer")
        aux_mu, aux_mu_end = _aux_from_config(config, aux_mu, aux_mu_end)
        check_mu(aux_mu=aux_mu, aux_mu_end=aux_mu_end)  # before the Trainer loads anything
        opts = digit_loss_options(digit_loss, default_type="ce")
        self.digit_loss_resume_mismatch = check_resume_mismatch(mismatch)
        with digit_trainer_building(config):
            super().__init__(*args, **kwargs)
        self.digit_loss = build_digit_loss(self.processing_class, opts, "DigitGRPOTrainer")
        self.aux_mu, self.aux_mu_end = float(aux_mu), aux_mu_end
        # what digit_loss.json records with each checkpoint, and a resume compares
        self.aux_settings = {**opts, "aux_mu": self.aux_mu, "aux_mu_end": aux_mu_end}
        self._gold: Optional[GoldBatch] = None
        self._check_columns(getattr(self.train_dataset, "column_names", None), "train_dataset")
        if self.aux_on:
            output_layer(self.model, "DigitGRPOTrainer")
            check_number_rows(self.model, self.digit_loss.vocab, self.processing_class, "DigitGRPOTrainer")

    def _check_columns(self, columns, where: str) -> None:
        """Refuse, before any generation, rows without what the auxiliary term (the gold token ids) or delft's
        rewards (their ``answer_column``) read; ``columns`` None (an IterableDataset without features): no check."""
        if columns is None:
            return
        needed = {c: "the auxiliary term (aux_mu > 0)" for c in GOLD_COLUMNS if self.aux_on}
        for fn in self.reward_funcs:
            column = answer_column_of(fn)
            if column is not None:
                needed.setdefault(column, f"the reward {getattr(getattr(fn, 'func', fn), '__name__', fn)!r}")
        missing = [c for c in needed if c not in columns]
        if missing:
            raise UserError(f"DigitGRPOTrainer: {where} has no column {', '.join(map(repr, missing))}, which "
                            f"{needed[missing[0]]} reads (its columns: {', '.join(map(str, columns)) or 'none'})",
                            fix=_COLUMNS_FIX)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, model, trial) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            save_settings(folder, self.aux_settings)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """TRL's ``train``, refusing (before anything loads) a checkpoint whose ``digit_loss.json`` holds another
        auxiliary term (digit loss, aux_mu, aux_mu_end), unless ``digit_loss_resume_mismatch="allow"``."""
        checkpoint = resumed_checkpoint(self, resume_from_checkpoint)
        check_resume(checkpoint, self.aux_settings, self.digit_loss_resume_mismatch,
                     name="digit_loss, aux_mu and aux_mu_end")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    @property
    def aux_on(self) -> bool:
        return self.aux_mu > 0 or bool(self.aux_mu_end)

    def current_mu(self) -> float:
        return mu_at(self.state.global_step, self.state.max_steps, self.aux_mu, self.aux_mu_end)

    # ------------------------------------------------------------------ the gold batch

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        if inputs and self.model.training:  # an IterableDataset's columns are known only now, before generating
            self._check_columns(list(inputs[0]), "a batch of train_dataset")
        out = super()._generate_and_score_completions(inputs)
        if self.model.training and "advantages" in out:  # the spread GRPO learns from (their mean is 0 by design)
            adv = out["advantages"].detach().float()
            self._metrics["train"]["advantages/abs_mean"].append(float(adv.abs().mean()))
        if self.aux_on and self.model.training:
            self._gold = self.gold_batch(inputs[:: self.num_generations])  # each prompt once, not per sample
        return out

    def gold_batch(self, rows: list[dict]) -> GoldBatch:
        """The gold solutions of ``rows``, split over the micro-steps of one generation batch, with their counts."""
        loss, device = self.digit_loss.loss, self.accelerator.device
        items = [Tokenized(list(r["gold_input_ids"]), list(r["gold_labels"])) for r in rows]
        steps = self.args.steps_per_generation
        bounds = [len(items) * k // steps for k in range(steps + 1)]
        pad = self.processing_class.pad_token_id if self.processing_class.pad_token_id is not None else 0
        parts, counts = [], None
        for lo, hi in zip(bounds, bounds[1:]):
            if hi == lo:
                parts.append(None)
                continue
            batch = {k: v.to(device) for k, v in collate(items[lo:hi], pad).items()}
            parts.append(batch)
            part_counts = loss.count(batch["labels"][:, 1:])
            counts = part_counts if counts is None else counts + part_counts
        return GoldBatch(parts, self._all_ranks(counts))

    def _all_ranks(self, counts):
        if self.accelerator.num_processes == 1:
            return counts
        t = torch.tensor(list(counts), dtype=torch.int64, device=self.accelerator.device)
        t = self.accelerator.reduce(t, reduction="sum")
        return type(counts)(int(t[0]), int(t[1]))

    # ------------------------------------------------------------------ the loss

    def aux_loss(self, model, batch: dict, counts):
        """delft's SFT loss of one gold part, normalised by the whole gold batch's ``counts`` (delft.losses)."""
        with last_hidden_states(self.accelerator.unwrap_model(model)) as (captured, head):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                  logits_to_keep=torch.zeros(0, dtype=torch.long, device=batch["input_ids"].device))
        sums = self.digit_loss.sums(captured["hidden"][:, :-1], head, batch["labels"][:, 1:])
        return self.digit_loss.loss.combine(sums, counts), sums

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mu = self.current_mu()
        if not (self.aux_on and model.training and self._gold is not None):
            return loss
        part = self._gold.parts[self._step % self.args.steps_per_generation]
        if part is not None:
            aux, sums = self.aux_loss(model, part, self._gold.counts)
            # DDP averages the ranks' gradients; the aux is normalised over every rank's gold, so scale it back up
            loss = loss + mu * aux * self.accelerator.num_processes
            self._log_aux(sums)
        self._metrics["train"]["aux/mu"].append(mu)
        return loss

    def _log_aux(self, sums) -> None:
        """The gold batch's CE and digit term: TRL logs the mean of what a step appends, so each part appends its
        share times the number of parts, and the mean is the whole batch's value."""
        counts, parts = self._gold.counts, sum(p is not None for p in self._gold.parts)
        self._metrics["train"]["aux/ce"].append(parts * float(sums.ce.detach()) / max(1, counts.labels))
        term = parts * float(sums.term.detach()) / counts.digits if counts.digits else 0.0
        self._metrics["train"]["aux/digit_term"].append(term)


def _pair_text(tokenizer, prompt: Any, completion: Any) -> tuple[Any, str]:
    """(the prompt as TRL tokenises it: its text, or its messages; the completion's text up to the end of turn)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion + (tokenizer.eos_token or "")
    if isinstance(prompt, list) and isinstance(completion, list):
        shown = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if not full.startswith(shown):
            raise UserError("the chat template does not render the prompt's messages as the start of the whole "
                            "conversation, so the completion's tokens cannot be told from the prompt's",
                            fix="Use a tokenizer whose chat template renders a conversation prefix-stable.")
        return prompt, full[len(shown):]
    raise UserError(f"a row's prompt and completion are {type(prompt).__name__} and {type(completion).__name__}: "
                    "add_gold_columns takes TRL's standard (two strings) or conversational (two lists of messages) "
                    "prompt-completion rows", fix="Give both columns in one of the two forms.")


def gold_ids(tokenizer, prompt: Any, completion: Any, max_length: Optional[int] = None) -> dict:
    """``{"gold_input_ids", "gold_labels"}`` of one row: the prompt tokenised as TRL's GRPOTrainer tokenises it
    (the tokenizer's call on a string, the chat template with the generation prompt on messages), then the
    completion with its end of turn; the prompt's labels -100, both cut to ``max_length`` tokens."""
    prompt, completion = _pair_text(tokenizer, prompt, completion)
    if isinstance(prompt, str):
        p_ids = list(tokenizer(text=prompt)["input_ids"])
    else:
        p_ids = list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"])
    c_ids = tokenizer.encode(completion, add_special_tokens=False)
    ids, labels = p_ids + c_ids, [IGNORE] * len(p_ids) + list(c_ids)
    end = len(ids) if max_length is None else max_length
    return {GOLD_COLUMNS[0]: ids[:end], GOLD_COLUMNS[1]: labels[:end]}


def add_gold_columns(dataset, tokenizer, max_length: Optional[int] = None, prompt_column: str = "prompt",
                     completion_column: str = "completion"):
    """``dataset`` (a datasets ``Dataset`` or ``IterableDataset`` of prompt/completion rows) with the columns
    ``gold_input_ids`` and ``gold_labels`` that DigitGRPOTrainer's auxiliary term trains on (``gold_ids``)."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        missing = [c for c in (prompt_column, completion_column) if c not in columns]
        if missing:
            raise UserError(f"add_gold_columns reads the columns {prompt_column!r} and {completion_column!r}; the "
                            f"dataset has no {', '.join(map(repr, missing))} (its columns: {', '.join(columns)})",
                            fix="Name the columns that hold them: add_gold_columns(ds, tok, prompt_column=..., "
                            "completion_column=...).")
    return dataset.map(lambda row: gold_ids(tokenizer, row[prompt_column], row[completion_column], max_length))
