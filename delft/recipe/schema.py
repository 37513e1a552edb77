"""The recipe schema: one typed section per YAML block (model, quantization, lora, data, train, grpo, loss, eval,
output), each key with its default, bounds and a description that is its documentation. An unknown key is
refused with a did-you-mean; a wrong value with the key's path and what it accepts. Torch-free: the CLI and
``delft recipe check`` load it without torch.

The sections live one module per part of the recipe (``section``: their base; ``model_section``: model,
quantization, lora; ``train_section``: train, grpo; the data, loss, eval and output sections here), and the
whole ``Recipe`` here with every refusal that reads more than one section, so ``delft recipe check`` refuses what
``delft train`` would refuse from the recipe alone, in the same words."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from delft.data.columns import columns_refusal
from delft.data.number_tasks import MAX_LENGTH as NUPA_MAX_LENGTH
from delft.data.number_tasks import MAX_PER_BIN as NUPA_MAX_PER_BIN
from delft.data.number_tasks import TASKS as NUPA_TASKS
from delft.data.number_tasks import bins_text, drawn_counts, short_bins
from delft.errors import UserError
from delft.losses.registry import GLOBAL, LOSS_KINDS, LOSS_TYPES, NORMALISATIONS, type_names
from delft.numbers.digits import DEFAULT_PLACE_WEIGHT_CAP, PLACE_WEIGHTS
from delft.numbers.formats import NumberForm
from delft.recipe.model_section import MUTATING_INITS, LoraConfig, ModelConfig, QuantizationConfig, resolve_quantization
from delft.recipe.section import Section
from delft.recipe.train_section import EIGHT_BIT_OPTIMIZERS, GrpoConfig, TrainConfig

# Added to a generator's seed for the default eval set, so its draw does not start with the training problems; the
# training problems are kept out by content when it is drawn (delft.evaluation.contamination), which a seed cannot do.
EVAL_SEED_OFFSET = 1_000_003



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
        """Whether any number is written other than naturally (delft.numbers.formats.NumberForm's rule)."""
        return NumberForm.of(self).active


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
                if self.format == name and "format" not in self.model_fields_set:  # the default format kept
                    if self.source in GENERATED:
                        raise ValueError(f"source {self.source!r} is generated by delft and goes with format "
                                         f"{self.source!r}, and the format was left at its default ({name!r}): add "
                                         f"format: {self.source}")
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


class LossConfig(Section):
    # Read from the loss table (docs/recipe_keys.md is generated from these descriptions).
    type: Literal[tuple(LOSS_TYPES)] = Field(  # type: ignore[valid-type]
        "del", description=f"The loss: {LOSS_KINDS}. "
        + "; ".join(f"{t.name}: {t.summary}" for t in LOSS_TYPES.values()))
    weight: Optional[float] = Field(
        None, ge=0, description="lambda in CE + lambda * term, for the types with a digit term; default per type ("
        + ", ".join(f"{t.name} {t.default_weight:g}" for t in LOSS_TYPES.values() if t.has_term) + "). "
        f"No term to weigh in {type_names(lambda t: not t.has_term, ' or ')} ({type_names(lambda t: t.replaces_ce)} "
        "refuses a weight).")
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
    def _sharding(self):
        """What train.distributed fsdp cannot do, from the recipe alone (training's launch checks are in
        delft.training.sharding.check_launch)."""
        t = self.train
        if t.distributed != "fsdp":
            return self
        if self.quantization.mode == "nf4":
            raise ValueError("train.distributed fsdp shards bf16 or fp32 weights; FSDP2 cannot shard bitsandbytes' "
                             "packed nf4 weights here: set quantization.mode: none (LoRA on a sharded bf16 base "
                             "usually fits where QLoRA was needed), or keep nf4 with distributed: ddp")
        if t.stage == "grpo":
            raise ValueError("train.distributed fsdp applies to train.stage sft; GRPO runs on TRL's GRPOTrainer "
                             "(use its accelerate FSDP config, or distributed: ddp)")
        if t.finetuning == "lora" and not self.model.adapter and self.lora.init in MUTATING_INITS:
            raise ValueError(f"lora.init {self.lora.init} changes the base weights and converts the adapter against "
                             "them at the end, which delft does on whole weights, not on FSDP's shards: use "
                             "lora.init: default (or gaussian) with train.distributed fsdp, or train it with ddp")
        if t.optimizer in EIGHT_BIT_OPTIMIZERS:
            raise ValueError(f"train.optimizer {t.optimizer} is bitsandbytes' optimizer, which cannot step FSDP's "
                             "sharded weights (DTensors): use train.optimizer: adamw with train.distributed fsdp "
                             "(its states are sharded too)")
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

    def quantization_on(self, device: str) -> str:
        """quantization.mode resolved on ``device`` ("nf4", "int8" or "none"): the one rule (resolve_quantization)
        for training and the memory plan alike."""
        t = self.train
        return resolve_quantization(self.quantization.mode, device, t.finetuning, t.distributed)

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
