"""The recipe schema: one typed section per YAML block (model, quantization, lora, data, train, grpo, loss, eval,
output), each key with its default, bounds and a description that is its documentation. An unknown key is
refused with a did-you-mean; a wrong value with the key's path and what it accepts. Torch-free: the CLI and
``delft recipe check`` load it without torch."""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from delft.data.columns import columns_refusal
from delft.data.number_tasks import MAX_LENGTH as NUPA_MAX_LENGTH
from delft.data.number_tasks import MAX_PER_BIN as NUPA_MAX_PER_BIN
from delft.data.number_tasks import TASKS as NUPA_TASKS
from delft.data.number_tasks import bins_text, drawn_counts, short_bins
from delft.errors import UserError
from delft.losses.registry import GLOBAL, LOSS_TYPES, NORMALISATIONS
from delft.numbers.digits import DEFAULT_PLACE_WEIGHT_CAP, PLACE_WEIGHTS

# Added to a generator's seed for the default eval set, so its draw does not start with the training problems; the
# training problems are kept out by content when it is drawn (delft.evaluation.contamination), which a seed cannot do.
EVAL_SEED_OFFSET = 1_000_003


class Section(BaseModel):
    # Typos must fail loudly ("quantizaton: 4bit" silently passing is a peer's bug we do not repeat).
    # No inf/nan: an infinite learning rate or loss weight is never meant.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_yaml_booleans(cls, data):
        """YAML reads yes/no/on/off as booleans: refuse one where a number or a name is expected (pydantic would
        make ``learning_rate: yes`` 1.0), and read on/off as the words for a field that offers them."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if not isinstance(value, bool) or field is None or _accepts(field.annotation, value):
                continue
            word = ("off", "on")[value]
            if _accepts(field.annotation, word):
                data[key] = word
            else:
                raise ValueError(f"{key} got the YAML boolean {value} (from yes/no/on/off/true/false), "
                                 f"which is not a {_kind(field.annotation)}")
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _plain_value(cls, value, info: ValidationInfo):
        """No NUL character in any text (no path, name or prompt holds one; the OS cuts paths at it), and no whole
        number past 64 bits (a seed of 1e30 would overflow torch's generators deep inside training)."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, dict) and _holds_section(annotation):
            return value  # the section checks its own keys, so the message names the key
        if _has_nul(value):
            raise ValueError("holds a NUL character (\\0), which no path, name or text may hold")
        if _whole(annotation):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 2 ** 63:
                    raise ValueError("too large for a whole number (at most 2**63 - 1)")
        return value


def _has_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return isinstance(value, (list, tuple)) and any(_has_nul(v) for v in value)


def _holds_section(annotation) -> bool:
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in (annotation, *typing.get_args(annotation)))


def _whole(annotation) -> bool:
    """Whether a field holds whole numbers: int, Optional[int], a list or tuple of them."""
    return annotation is int or any(_whole(a) for a in typing.get_args(annotation))


def _accepts(annotation, value) -> bool:
    """Whether a field's type takes ``value`` as it is: bool for a bool field, a word for a Literal that lists it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return value in args and not isinstance(value, bool)
    if origin is Union:
        return any(_accepts(a, value) for a in args)
    return annotation is bool and isinstance(value, bool)


def _kind(annotation) -> str:
    names = {int: "whole number", float: "number", str: "text"}
    found = [names[a] for a in (annotation, *typing.get_args(annotation)) if a in names]
    return found[0] if found else "choice such as " + ", ".join(repr(a) for a in typing.get_args(annotation)[:4])


CHAR_TOKENIZER = "char"  # model.tokenizer: delft's character-level tokenizer (every digit one token)


class ArchitectureConfig(Section):
    """A Llama-style decoder built from random weights (model.init: scratch)."""

    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    layers: int = Field(4, gt=0, description="Decoder layers.")
    heads: int = Field(4, gt=0, description="Attention heads (hidden_size must divide by it).")
    kv_heads: Optional[int] = Field(None, gt=0, description="Key/value heads (grouped-query attention); unset: heads.")
    intermediate_size: int = Field(384, gt=0, description="Width of the SwiGLU MLP.")
    context: int = Field(128, gt=8, description="Most positions (data.max_length must fit in it).")
    tie_embeddings: bool = Field(True, description="Share the input embedding and the output layer (small models).")

    @model_validator(mode="after")
    def _shapes(self):
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not divide into {self.heads} heads")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} does not divide into {self.kv_heads} kv_heads")
        return self


class ModelConfig(Section):
    name: str = Field("smollm2-135m", description="Hub id, local directory, .gguf file, or the alias 'smollm2-135m' "
                      "(not read with init: scratch).")
    init: Literal["pretrained", "scratch"] = Field(
        "pretrained", description="pretrained: model.name's weights; scratch: random weights in the shape of "
        "model.architecture, trained from nothing (needs train.finetuning: full).")
    architecture: Optional[ArchitectureConfig] = Field(
        None, description="init: scratch only: the Llama-style shape (hidden_size, layers, heads, ...).")
    tokenizer: Optional[str] = Field(
        None, description=f"init: scratch only: '{CHAR_TOKENIZER}' (delft's character-level tokenizer: every digit, "
        "letter and sign one token; the default) or a tokenizer source (directory, hub id, 'smollm2-135m').")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' uses CUDA when present, else CPU.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/compute dtype; 'auto' = bf16 on CUDA (fp16 if unsupported), fp32 on CPU.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off: it runs arbitrary code).")
    adapter: Optional[str] = Field(None, description="A LoRA run directory (delft train's, or any peft adapter of "
                                   "this base model) to continue training, e.g. runs/sft before a GRPO stage; its "
                                   "rank and targets replace the lora section's.")

    @model_validator(mode="after")
    def _init(self):
        if self.init == "scratch":
            if self.adapter is not None:
                raise ValueError("init: scratch has no adapter to continue (drop model.adapter)")
            if self.architecture is None:
                object.__setattr__(self, "architecture", ArchitectureConfig())
            if self.tokenizer is None:
                object.__setattr__(self, "tokenizer", CHAR_TOKENIZER)
        elif self.architecture is not None or self.tokenizer is not None:
            raise ValueError("architecture and tokenizer only apply to init: scratch (a pretrained model has its own)")
        return self


class QuantizationConfig(Section):
    mode: Literal["auto", "nf4", "none"] = Field("auto", description="'auto' = nf4 on CUDA for LoRA (QLoRA), none "
                                                 "on CPU and with full fine-tuning.")
    double_quant: bool = Field(True, description="Quantise the nf4 scales too (saves ~0.4 bit/param).")
    kbit_upcast: bool = Field(
        False, description="Call peft's prepare_model_for_kbit_training (fp32 upcasts; costs much VRAM, see docs/gpu.md).")


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="'all-linear' (every linear projection except the output layer) or module names.")
    use_dora: bool = Field(False, description="DoRA (arXiv 2402.09353): a trained magnitude per output beside the "
                           "LoRA direction (peft's use_dora); merges like LoRA.")
    use_rslora: bool = Field(False, description="rsLoRA: scale alpha / sqrt(r) instead of alpha / r (steadier at "
                             "large ranks; peft's use_rslora).")
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained in full and saved with "
                                       "the adapter, e.g. [embed_tokens, lm_head] when new tokens are trained.")
    init: Literal["default", "gaussian", "pissa", "olora"] = Field(
        "default", description="peft's init_lora_weights: default (B = 0, A Kaiming), gaussian, pissa (the principal "
        "singular vectors, arXiv 2404.02948), olora (a QR of the weights); pissa and olora move the base weights, so "
        "the saved adapter is converted (rank 2r) to apply to the original base, as peft documents.")


MAX_SYNTHETIC_DIGITS = 30  # long operands for the far places; answers stay exact (digits.DECIMAL_PRECISION)


GENERATED = ("synthetic", "reasoning_gym", "nupa")  # sources made by a generator: their format is their name

# data.separator when unset: the text between a plain prompt and its completion, per format. prompt_completion rows
# are the user's own text, joined exactly as written (as TRL joins them): "6890+4=" and "6894" train as
# "6890+4=6894". The other formats are questions delft makes into prompts (its arithmetic, reasoning-gym's,
# GSM8K's, SVAMP's, the alpaca template, chat messages without a template): the answer starts on a line of its own,
# as delft rendered them before the key existed.
FORMAT_SEPARATORS = {"prompt_completion": "", "alpaca": "\n", "chat": "\n", "gsm8k": "\n", "svamp": "\n",
                     "synthetic": "\n", "reasoning_gym": "\n", "nupa": "\n"}


class SyntheticConfig(Section):
    n: int = Field(2000, gt=0, description="Number of problems generated.")
    seed: int = Field(0, description="Generator seed (the eval set draws with another and skips training problems).")
    ops: list[Literal["+", "-", "*", "/", "copy"]] = Field(
        ["+", "-", "*", "/"], min_length=1,
        description="Operations; 'copy' asks to repeat one number ('Repeat 123' -> 123).")
    min_digits: int = Field(1, ge=1, le=MAX_SYNTHETIC_DIGITS, description="Fewest digits in an operand's integer part.")
    max_digits: int = Field(3, ge=1, le=MAX_SYNTHETIC_DIGITS,
                            description=f"Most digits in an operand's integer part (up to {MAX_SYNTHETIC_DIGITS}).")
    second_digits: Optional[tuple[int, int]] = Field(
        None, description="[fewest, most] digits of the second operand (e.g. [2, 2] for 3-digit x 2-digit "
        "products with min_digits = max_digits = 3); unset: as the first. Division: the divisor's.")
    decimal_fraction: float = Field(0.25, ge=0, le=1, description="Share of problems with decimal operands.")
    negative_fraction: float = Field(0.15, ge=0, le=1, description="Share of operands that are negative.")
    style: Literal["question", "compact"] = Field(
        "question", description="How a problem is written: question ('What is 12 + 305?', the answer on the next "
        "line) or compact ('12+305=', the answer right after the '='; the from-scratch studies' form, which small "
        "models learn far sooner). 'copy' problems are 'Repeat 123' in both.")

    @model_validator(mode="after")
    def _digits_order(self):
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) is larger than max_digits ({self.max_digits})")
        if self.second_digits is not None:
            low, high = self.second_digits
            if not 1 <= low <= high <= MAX_SYNTHETIC_DIGITS:
                raise ValueError(f"second_digits {list(self.second_digits)} must be [fewest, most] with "
                                 f"1 <= fewest <= most <= {MAX_SYNTHETIC_DIGITS}")
        return self


class ReasoningGymConfig(Section):
    task: str = Field("basic_arithmetic", min_length=1, description="A reasoning-gym task (its procedural "
                      "generators need no download): basic_arithmetic, decimal_arithmetic, gsm_symbolic, chain_sum, "
                      "products, ... (`python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'`).")
    options: dict[str, Any] = Field(default_factory=dict, description="The task's own settings (its config "
                                    "dataclass), e.g. {min_digits: 2, max_digits: 3}; unknown ones are refused.")
    n: int = Field(1000, gt=0, description="Number of problems generated.")
    seed: int = Field(0, ge=0, description="Generator seed (eval uses a different one, as for synthetic).")
    completion: Literal["answer", "cot"] = Field(
        "answer", description="What training completes: the bare answer, or the task's worked solution where it "
        "has one (gsm_symbolic's answer_cot, ending '#### N').")


class NupaConfig(Section):
    """The digit-level benchmark (delft.data.number_tasks, docs/number_formats.md#the-number-task-benchmark): the
    Number Cookbook's integer and decimal tasks, binned by operand length."""

    tasks: list[str] = Field(default_factory=lambda: list(NUPA_TASKS), min_length=1, description="Tasks, kind/task: "
                             + ", ".join(NUPA_TASKS) + " (default: all).")
    min_length: int = Field(2, ge=1, le=NUPA_MAX_LENGTH, description="Shortest operand length bin, in digits "
                            "(one-digit bins hold few problems: integer/round 9, integer/length 10).")
    max_length: int = Field(10, ge=1, le=NUPA_MAX_LENGTH, description=f"Longest operand length bin (up to "
                            f"{NUPA_MAX_LENGTH} digits).")
    per_bin: int = Field(10, gt=0, le=NUPA_MAX_PER_BIN, description="Problems per task and length bin, each bin "
                         "checked against how many distinct problems it holds (two-digit integer/length has 90).")
    seed: int = Field(0, ge=0, description="Generator seed (eval draws with another and skips training problems).")

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        unknown = [t for t in tasks if t not in NUPA_TASKS]
        if unknown:
            raise ValueError(f"no number task {', '.join(map(repr, unknown))}; use some of {', '.join(NUPA_TASKS)}")
        return tasks

    @model_validator(mode="after")
    def _length_order(self):
        if self.min_length > self.max_length:
            raise ValueError(f"min_length ({self.min_length}) is larger than max_length ({self.max_length})")
        short = short_bins(self.per_bin, self.tasks, self.lengths())
        if short:
            raise ValueError(f"per_bin {self.per_bin} is more than some bins hold: {bins_text(short)}; ask "
                             "for fewer per bin, or leave the shortest lengths out (a larger min_length)")
        return self

    def lengths(self) -> range:
        return range(self.min_length, self.max_length + 1)

    def drawn(self, limit: Optional[int] = None) -> dict[tuple[str, int], int]:
        """How many problems each (task, length) bin gives to this draw's first ``limit`` problems."""
        return drawn_counts(self.per_bin, self.tasks, self.lengths(), limit)


class NumbersConfig(Section):
    """How numbers are written in the training text (delft.numbers.formats, docs/number_formats.md); eval and
    held-out accuracy read a run's answers back with the same form before scoring them."""

    order: Literal["natural", "reversed"] = Field(
        "natural", description="Digit order: natural, or reversed (each run of digits, '.' and ',' written back to "
        "front, least significant digit first: 1234.5 -> 5.4321; RevOrder).")
    count_prefix: bool = Field(False, description="Wrap every number with its digit count, {n:number} (42 -> "
                               "{2:42}, 1234.5 -> {4.1:1234.5}; NumeroLogic).")
    scope: Literal["answer", "completion", "everything"] = Field(
        "completion", description="Which numbers are rewritten: answer (only the completion's last number, its "
        "final answer), completion (every number of the trained completion) or everything (the prompts' numbers "
        "too, in training, eval and held-out accuracy alike).")

    def active(self) -> bool:
        """Whether any number is written other than naturally."""
        return self.order != "natural" or self.count_prefix


class DataConfig(Section):
    source: str = Field("synthetic", description="'synthetic', 'reasoning_gym', a local .jsonl/.json/.csv/.parquet "
                        "file, or a hub id.")
    format: Literal["prompt_completion", "alpaca", "chat", "gsm8k", "svamp", "synthetic", "reasoning_gym",
                    "nupa"] = Field(
        "synthetic", description="How rows map to prompt and answer.")
    columns: Optional[dict[str, str]] = Field(
        None, description="The file's column for each field the format reads, e.g. {prompt: question, completion: "
        "answer} (as axolotl's field_* and LLaMA-Factory's columns keys); unset: the format's own field names.")
    split: str = Field("train", description="Split of a hub dataset.")
    subset: Optional[str] = Field(None, description="Configuration (subset) of a hub dataset.")
    template: Literal["auto", "chat", "plain"] = Field(
        "auto", description="Prompt rendering: the tokenizer's chat template ('auto' uses it when present) or plain text.")
    system_prompt: Optional[str] = Field(None, description="System message for chat templates.")
    separator: Optional[str] = Field(
        None, description="Text between a plain prompt (no chat template) and its completion, e.g. ' ' or '\\n'; a "
        "prompt that already ends in a space or newline gets none. Unset: the format's default, '' for "
        "prompt_completion (the text as written, as TRL joins it), a newline for the others.")
    max_length: int = Field(256, gt=8, description="Tokens per example; longer examples are truncated (and counted).")
    limit: Optional[int] = Field(None, gt=0, description="Use only the first N rows.")
    train_on_prompt: bool = Field(False, description="Also compute the loss on prompt tokens (default: completion only).")
    val_size: float = Field(0.05, ge=0, description="Validation split: a fraction (<1) or a number of rows (>=1).")
    packing: bool = Field(False, description="Pack short examples into rows (no attention across examples).")
    numbers: NumbersConfig = Field(default_factory=NumbersConfig, description="How numbers are written in the "
                                   "training text (reversed digits, digit-count prefixes) and read back in eval.")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig, description="The built-in arithmetic source.")
    nupa: NupaConfig = Field(default_factory=NupaConfig, description="The digit-level benchmark (source nupa): "
                             "number tasks binned by length.")
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig,
                                              description="Generated problems from reasoning-gym (source reasoning_gym).")

    @model_validator(mode="after")
    def _source_format(self):
        for name in GENERATED:
            if (self.source == name) != (self.format == name):
                if self.format == name and "format" not in self.model_fields_set:
                    raise ValueError(f"source {self.source!r} is not '{name}', so it needs a format (the default, "
                                     f"'{name}', goes with source '{name}' only): add format: prompt_completion "
                                     "(fields prompt and completion), or alpaca, chat, "
                                     "gsm8k or svamp")
                raise ValueError(f"source '{name}' goes with format '{name}' (and only it)")
        refusal = columns_refusal(self.format, self.columns)
        if refusal:
            raise ValueError(refusal)
        return self

    def prompt_separator(self) -> str:
        """What follows a plain prompt before its completion: data.separator, else the format's default (none
        after a compact synthetic problem's '=', which is where its answer starts)."""
        if self.separator is not None:
            return self.separator
        if self.format == "synthetic" and self.synthetic.style == "compact":
            return ""
        return FORMAT_SEPARATORS[self.format]


class EarlyStoppingConfig(Section):
    metric: Literal["val_loss", "heldout_accuracy"] = Field(
        "val_loss", description="What is watched: the validation loss (every train.eval_steps; lower is better) or "
        "the held-out exact match (every train.accuracy_steps; higher is better).")
    patience: int = Field(3, gt=0, description="Stop after this many measurements in a row without an improvement.")
    min_delta: float = Field(0.0, ge=0, description="An improvement must beat the last counted one by more than "
                             "this to reset patience; the best step is always the lowest (highest) measured.")


class TrainConfig(Section):
    stage: Literal["sft", "grpo"] = Field(
        "sft", description="sft: supervised fine-tuning on the completions; grpo: reinforcement learning from "
        "verifiable numeric rewards on the data's prompts (TRL's GRPOTrainer; the grpo section).")
    finetuning: Literal["lora", "full"] = Field(
        "lora", description="lora: train a LoRA adapter (the lora section) on the frozen base; full: train every "
        "weight (the paper's setting; the run saves a standalone model, no merge step).")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "sgd"] = Field(
        "adamw", description="adamw: AdamW with fp32 states (bitsandbytes' 32-bit AdamW when weights are bf16/fp16, "
        "so the states stay fp32); adamw_8bit: bitsandbytes' 8-bit AdamW (a quarter of the state memory); "
        "paged_adamw_8bit: the same, its states paged to CPU memory under pressure (CUDA only; adamw_8bit runs on "
        "the CPU too); sgd: plain SGD with momentum (no state without momentum).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's beta1 and beta2 (the AdamW optimizers).")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only: momentum (0: none).")
    snapshot_steps: list[int] = Field(
        default_factory=list, description="Steps at which a copy of the model (or adapter) is kept in "
        "snapshots/step-N of the run, for learning curves (delft study's curve evaluates them).")
    max_steps: Optional[int] = Field(None, gt=0, description="Optimizer steps; overrides epochs when set.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training set (when max_steps is unset).")
    batch_size: int = Field(8, gt=0, description="Examples per micro-batch.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate (LoRA likes 1e-4..5e-4).")
    lr_scheduler: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="After warmup: cosine or linear decay to 0, constant, or wsd (warmup-stable-decay: "
        "constant, then a cosine decay over the last decay_ratio of the steps).")
    decay_ratio: float = Field(0.1, gt=0, le=1, description="wsd only: the share of steps spent decaying at the end.")
    neftune_alpha: Optional[float] = Field(
        None, gt=0, description="NEFTune (arXiv 2310.05914, as TRL and transformers' Trainer have it): uniform noise "
        "of magnitude alpha / sqrt(positions x hidden size) on the input embeddings while training (e.g. 5); "
        "unset: off.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Share of steps spent warming up linearly.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping (0 = off).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seeds the LoRA init, data order and dropout (0 to "
                      "2**32 - 1, numpy's range).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward (less memory).")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp", description="With several processes (--nproc, torchrun): ddp keeps the whole model on every rank and "
        "sums the trainable gradients; fsdp shards weights, gradients and optimizer states over the ranks with "
        "PyTorch's FSDP2 (fully_shard per decoder layer, then the model), for models that outgrow one card "
        "(docs/distributed.md). fsdp needs a launcher, and no nf4.")
    cpu_offload: bool = Field(False, description="fsdp on CUDA only: keep the sharded weights, gradients and "
                              "optimizer states in CPU memory between uses (FSDP2's CPUOffloadPolicy; slower).")
    logging_steps: int = Field(5, gt=0, description="Steps between log lines (metrics.jsonl).")
    eval_steps: int = Field(50, gt=0, description="Steps between validation-loss evaluations.")
    save_steps: int = Field(100, gt=0, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(2, gt=0, description="Most recent checkpoints kept.")
    loss_chunk_size: int = Field(1024, gt=0, description="Tokens per chunk of the output layer (memory vs speed).")
    fused_loss: Literal["auto", "on", "off"] = Field(
        "auto", description="Liger's fused linear cross-entropy on CUDA with Triton; 'off' = pure-torch chunks.")
    accuracy_steps: int = Field(
        0, ge=0, description="Steps between held-out greedy exact-match measurements (0 = off); see accuracy_examples.")
    accuracy_examples: int = Field(
        32, gt=0, description="Problems in that held-out slice: the first N of the eval set (as delft eval --limit N).")

    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers that get every metrics.jsonl row, the recipe as the "
        "run's config and the loss plot: tensorboard (run_dir/tensorboard), wandb (offline unless WANDB_MODE says "
        "otherwise), mlflow (run_dir/mlruns unless MLFLOW_TRACKING_URI); each an extra. metrics.jsonl stays the "
        "source of truth.")
    early_stopping: Optional[EarlyStoppingConfig] = Field(
        None, description="Stop when the metric stops improving ({metric, patience, min_delta}); unset: train to "
        "the end.")
    keep_best: bool = Field(False, description="Write the best measurement's model (or adapter) at the end instead "
                            "of the last one (the early_stopping metric, else val_loss); delft_run.json says which "
                            "step and why.")

    @model_validator(mode="after")
    def _optimizer_keys(self):
        fields = type(self).model_fields
        if self.optimizer != "sgd" and self.momentum != fields["momentum"].default:
            raise ValueError("momentum only applies to optimizer sgd (AdamW has betas)")
        if self.optimizer == "sgd" and self.betas != fields["betas"].default:
            raise ValueError("betas only apply to the AdamW optimizers, not sgd (it has momentum)")
        if self.lr_scheduler != "wsd" and self.decay_ratio != fields["decay_ratio"].default:
            raise ValueError("decay_ratio only applies to lr_scheduler wsd")
        metric = self.early_stopping.metric if self.early_stopping else ("val_loss" if self.keep_best else None)
        if metric == "heldout_accuracy" and not self.accuracy_steps:
            raise ValueError("early_stopping.metric heldout_accuracy is measured every train.accuracy_steps: set it")
        if self.cpu_offload and self.distributed != "fsdp":
            raise ValueError("cpu_offload moves FSDP's shards to CPU memory: it needs distributed: fsdp")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), not {list(self.betas)}")
        late = [s for s in self.snapshot_steps if self.max_steps is not None and s > self.max_steps]
        if late:  # never taken; with epochs train checks once the data gives the total (schedule.check_snapshot_steps)
            raise ValueError(f"snapshot_steps {late[:5]} come after train.max_steps {self.max_steps}, so they would "
                             f"never be taken: give steps of at most {self.max_steps}")
        return self

    @field_validator("snapshot_steps")
    @classmethod
    def _snapshots(cls, steps: list[int]) -> list[int]:
        if any(s <= 0 for s in steps):
            raise ValueError("snapshot steps are optimizer steps, 1 or more")
        return sorted(set(steps))


class GrpoConfig(Section):
    num_generations: int = Field(4, ge=2, description="Completions sampled per prompt (the group GRPO normalises "
                                 "rewards within).")
    max_completion_length: int = Field(32, gt=0, description="Tokens per sampled completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    beta: float = Field(0.0, ge=0, description="KL penalty to the reference model (0: no reference model kept).")
    reward: Literal["exact", "partial"] = Field(
        "exact", description="exact: 1 when delft's answer scorer finds the gold number, else 0; partial: exact plus "
        "partial_alpha x the place-weighted share of right digits, each normalised within its group before the sum.")
    partial_alpha: float = Field(0.2, ge=0, le=1, description="Weight of the digit share in the partial reward.")
    reward_functions: list[str] = Field(default_factory=list, description="More TRL reward functions, as "
                                        "'module:function' (weight 1 each), after delft's.")
    aux_mu: float = Field(0.0, ge=0, description="mu: the auxiliary term's weight, mu x (CE + loss.weight x the digit "
                          "term) on the gold solutions of the same prompts (0: GRPO alone).")
    aux_mu_end: Optional[float] = Field(None, ge=0, description="Decay mu linearly to this by the last step "
                                        "(CHORD: 0.9 -> 0.05); unset: constant.")


class LossConfig(Section):
    type: Literal[tuple(LOSS_TYPES)] = Field(  # type: ignore[valid-type]
        "del", description="The digit term added to CE: "
        + "; ".join(f"{t.name}: {t.summary}" for t in LOSS_TYPES.values()))
    weight: Optional[float] = Field(
        None, ge=0, description="lambda in CE + lambda * term; default per type ("
        + ", ".join(f"{t.name} {t.default_weight:g}" for t in LOSS_TYPES.values() if t.has_term) + ").")
    tau: float = Field(1.0, gt=0, description="dist2 only: width of the soft target exp(-(k-y)^2/tau).")
    normalisation: Literal[NORMALISATIONS] = Field(  # type: ignore[valid-type]
        GLOBAL, description="global: CE per label + lambda x term per digit label, both over the optimizer batch; "
        "reference: as the DEL paper's code ran under HF Trainer (term a mean per micro-batch, x grad_accum), "
        "to reproduce it (docs/losses.md).")
    place_weights: Literal[PLACE_WEIGHTS] = Field(  # type: ignore[valid-type]
        "reference", description="DEL place weights: reference (2r for the r-th integer digit, unbounded), "
        "capped (at most place_weight_cap), uniform (1).")
    place_weight_cap: float = Field(DEFAULT_PLACE_WEIGHT_CAP, gt=0,
                                    description="place_weights: capped only: the largest integer-digit weight.")

    @model_validator(mode="after")
    def _defaults(self):
        kind = LOSS_TYPES[self.type]
        for name in {p for t in LOSS_TYPES.values() for p in t.params}:  # set for a type that does not read it
            if name not in kind.params and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name} only applies to type " + " / ".join(
                    f"'{t.name}'" for t in LOSS_TYPES.values() if name in t.params) + f", not '{self.type}'")
        if not kind.place_weighted and (self.place_weights != "reference"
                                        or self.place_weight_cap != DEFAULT_PLACE_WEIGHT_CAP):
            raise ValueError("place_weights only apply to the DEL types ("
                             + ", ".join(t.name for t in LOSS_TYPES.values() if t.place_weighted)
                             + f"), not '{self.type}'")
        if self.place_weight_cap != DEFAULT_PLACE_WEIGHT_CAP and self.place_weights != "capped":
            raise ValueError("place_weight_cap only applies to place_weights: capped")
        if kind.replaces_ce and self.weight not in (None, 0):
            raise ValueError(f"weight does not apply to type '{self.type}': it replaces CE with a weighted CE and adds "
                             "no term to weigh; drop weight")
        if self.weight is None:
            object.__setattr__(self, "weight", kind.default_weight)
        return self


class EvalConfig(Section):
    data: Optional[DataConfig] = Field(
        None, description="Eval set; default: the training source with another seed, its training problems skipped.")
    limit: Optional[int] = Field(200, gt=0, description="Evaluate at most N problems.")
    max_new_tokens: int = Field(32, gt=0, description="Generation budget per answer.")
    batch_size: int = Field(16, gt=0, description="Prompts generated together.")
    bootstrap: int = Field(1000, ge=0, description="Bootstrap resamples for confidence intervals.")
    fewshot: Optional[int] = Field(
        None, ge=0, le=8, description="lm-evaluation-harness's GSM8K prompt ('Question: ...\\nAnswer:') with this many "
        "exemplars (the first problems of GSM8K train; 0 = zero-shot); unset: the data's own prompt.")
    samples: int = Field(1, ge=1, le=64, description="Answers per problem: 1 = greedy; K > 1 samples K answers "
                         "(temperature, top_p) and scores their majority vote, with pass@1 and pass@K beside it.")
    temperature: float = Field(0.7, gt=0, le=5, description="Sampling temperature (samples > 1).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the likeliest tokens up to this "
                         "probability mass (samples > 1; 1 = off).")
    seed: int = Field(0, ge=0, description="Seeds the sampling: the same seed, batch size and eval set give the "
                      "same samples.")
    backend: Literal["transformers", "llama.cpp"] = Field(
        "transformers", description="What runs a .gguf base model (model.name / --model): transformers (the file "
        "dequantised) or llama.cpp (the file as people run it; the [gguf] extra). GGUF runs always use llama.cpp.")


# Linux allows 4096-byte paths and 255-byte names; delft writes below the run directory (checkpoints/step-N/...)
# and beside it (.NAME.lock, .NAME.tmp-PID-...), so a run directory's own path must leave room for those.
MAX_RUN_PATH, MAX_RUN_NAME = 1024, 200


class OutputConfig(Section):
    dir: str = Field("runs/quickstart", min_length=1, pattern=r"\S",
                     description="Run directory (relative to the current directory; ~ is your home).")

    @field_validator("dir")
    @classmethod
    def _home(cls, value: str) -> str:
        value = os.path.expanduser(value)
        if len(os.fsencode(os.path.abspath(value))) > MAX_RUN_PATH:
            raise ValueError(f"is {len(os.fsencode(os.path.abspath(value))):,} bytes long as an absolute path; a run "
                             f"directory's path may be at most {MAX_RUN_PATH} (delft writes files below it)")
        long = [n for n in Path(value).parts if len(os.fsencode(n)) > MAX_RUN_NAME]
        if long:
            raise ValueError(f"has a name of {len(os.fsencode(long[0])):,} bytes ({long[0][:20]}...); each name in "
                             f"the path may be at most {MAX_RUN_NAME} (delft adds suffixes beside it)")
        return value


class Recipe(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _finetuning(self):
        full = self.train.finetuning == "full"
        if self.model.init == "scratch" and not full:
            raise ValueError("model.init scratch has no pretrained weights for LoRA to adapt: set train.finetuning: "
                             "full")
        if full and self.quantization.mode == "nf4":
            raise ValueError("train.finetuning full trains every weight, and nf4 weights cannot be trained: set "
                             "quantization.mode: none (or auto), or use train.finetuning: lora (QLoRA)")
        if full and self.model.adapter is not None:
            raise ValueError("train.finetuning full trains the model itself; model.adapter continues a LoRA adapter "
                             "(drop one of them)")
        if full and self.train.stage == "grpo":
            raise ValueError("train.stage grpo trains a LoRA policy here; use train.finetuning: lora")
        lora = [k for k, f in LoraConfig.model_fields.items() if getattr(self.lora, k) != f.get_default(
            call_default_factory=True)]  # a saved recipe.yaml holds every key at its default: those say nothing
        if full and lora:
            raise ValueError(f"train.finetuning full trains every weight and ignores the lora section, which sets "
                             f"{', '.join('lora.' + k for k in lora)}: drop those keys (or set them back to their "
                             "defaults), or use train.finetuning: lora")
        if self.train.stage == "grpo":
            t, d = self.train, type(self.train).model_fields
            changed = [k for k in ("optimizer", "betas", "momentum", "neftune_alpha", "snapshot_steps", "report_to")
                       if getattr(t, k) != (d[k].default_factory() if d[k].default_factory else d[k].default)]
            if changed or t.lr_scheduler == "wsd":
                raise ValueError(f"train.stage grpo runs TRL's GRPOTrainer with its AdamW and schedules; "
                                 f"{', '.join(changed) or 'lr_scheduler wsd'} only apply to train.stage sft")
        if self.train.distributed == "fsdp" and self.quantization.mode == "nf4":
            raise ValueError("train.distributed fsdp shards bf16 or fp32 weights; FSDP2 cannot shard bitsandbytes' "
                             "packed nf4 weights here: set quantization.mode: none (LoRA on a sharded bf16 base "
                             "usually fits where QLoRA was needed), or keep nf4 with distributed: ddp")
        if self.train.distributed == "fsdp" and self.train.stage == "grpo":
            raise ValueError("train.distributed fsdp applies to train.stage sft; GRPO runs on TRL's GRPOTrainer "
                             "(use its accelerate FSDP config, or distributed: ddp)")
        tracked = self.train.early_stopping is not None or self.train.keep_best
        if tracked and (self.train.early_stopping is None or self.train.early_stopping.metric == "val_loss") \
                and self.data.val_size == 0:
            raise ValueError("early stopping and keep_best on val_loss need a validation split: set data.val_size")
        if tracked and self.train.stage == "grpo":
            raise ValueError("early_stopping and keep_best apply to train.stage sft")
        if self.model.init == "scratch" and self.data.max_length > self.model.architecture.context:
            raise ValueError(f"data.max_length {self.data.max_length} is longer than model.architecture.context "
                             f"{self.model.architecture.context}")
        return self

    @model_validator(mode="after")
    def _nupa_eval_draw(self):
        """The eval set's benchmark bins must hold its problems besides the training draw's, which it leaves out
        (train and eval refuse such a bin when they draw; this finds it from the bins' sizes, drawing nothing)."""
        test, train = self.eval_data(), self.data
        if test.source != "nupa" or train.source != "nupa":
            return self
        short = short_bins(test.nupa.per_bin, test.nupa.tasks, test.nupa.lengths(), train.nupa.drawn(train.limit))
        if short:
            key = "eval.data.nupa" if self.eval.data is not None else "data.nupa"
            raise ValueError(f"{key}.per_bin {test.nupa.per_bin}: the eval set draws that many per bin without the "
                             f"training problems, and some bins hold too few for both: {bins_text(short)}; ask "
                             "for fewer per bin, or leave the shortest lengths out (a larger min_length)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def eval_data(self) -> DataConfig:
        """The eval set: as given, or the training source with another generator seed (the training problems are
        skipped by content when it is drawn: delft.evaluation.contamination)."""
        if self.eval.data is not None:
            return self.eval.data
        data = self.data.model_copy(deep=True)
        data.synthetic = data.synthetic.model_copy(update={"seed": data.synthetic.seed + EVAL_SEED_OFFSET})
        data.reasoning_gym = data.reasoning_gym.model_copy(
            update={"seed": data.reasoning_gym.seed + EVAL_SEED_OFFSET})
        data.nupa = data.nupa.model_copy(update={"seed": data.nupa.seed + EVAL_SEED_OFFSET})
        data.val_size = 0
        return data


def _fields_at(loc: tuple, root: Any = None) -> list[str]:
    """Valid keys of the section that holds ``loc`` in ``root`` (default: Recipe), for did-you-mean."""
    model: Any = root or Recipe
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        for cand in getattr(ann, "__args__", (ann,)):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                model = cand
                break
        else:
            return []
    return list(getattr(model, "model_fields", {}))


def describe_error(err: dict, root: Any = None) -> str:
    """One pydantic error as 'key: what is wrong' (unknown keys get a did-you-mean among ``root``'s keys)."""
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc, root)
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(valid)}"
        return f"{key}: unknown key; {hint}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):  # pydantic's words name its classes
        keys = _fields_at((*loc, None), root)
        more = ", ..." if len(keys) > 6 else ""
        msg = "is a section of keys (key: value lines indented under it), not a single value" + \
            (f"; its keys: {', '.join(keys[:6])}{more}" if keys else "")
    if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
        shown = repr(err["input"])
        if err["input"] is None:  # `~`, `null` or nothing after the colon: YAML's null, rarely what was meant
            shown += ": YAML reads ~, null and an empty value as null; quote it, e.g. '~', to mean the text"
        return f"{key}: {msg} (got {shown if len(shown) <= 200 else shown[:197] + '...'})"
    return f"{key}: {msg}"


def validate_recipe(data: Any, where: str = "recipe") -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"the recipe must be a mapping of sections, not {type(data).__name__}", where,
                        "Start from a starter: delft recipe new quickstart my.yaml.")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(describe_error(err) for err in e.errors())
        raise UserError(f"invalid recipe: {problems}", where,
                        "Fix the key(s) named above; `delft recipe check FILE` validates without running.") from None
