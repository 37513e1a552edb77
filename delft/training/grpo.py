"""``delft train`` with ``train.stage: grpo``: reinforcement learning from verifiable numeric rewards, run by TRL's
GRPOTrainer (delft.integrations.grpo.DigitGRPOTrainer: the auxiliary digit term on the gold solutions), inside
the run lifecycle every stage shares (delft.training.run).

The lifecycle gives it the SFT stage's contract: the run lock, ``recipe.yaml``, ``delft_run.json`` with the same
keys, ``metrics.jsonl``, exact resume, Ctrl-C / SIGTERM saving the last whole step, and at the end the adapter and
tokenizer at the top of the run directory (free space checked, a full disk said in one paragraph), so eval,
inspect, export, compare and study take a GRPO run as they take an SFT run. TRL's own loop runs the steps
(generation, rewards, advantages, the clipped objective); this module gives it the rows, the rewards and the
config, and a callback that logs each step, renames transformers' checkpoints into ``checkpoints/step-NNNNNN``
once whole (a half-written one is never resumed), and stops the loop at the step's end when a signal came.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from delft import rundir
from delft.data.batches import tokenize_example
from delft.data.pipeline import load_examples
from delft.data.prompts import render_prompt
from delft.errors import UserError
from delft.losses.registry import LOSS_TYPES
from delft.models.loading import check_nf4_exact
from delft.numbers.answers import parse_number
from delft.numbers.formats import NumberForm
from delft.numbers.rewards import digit_reward, exact_reward, read_back
from delft.recipe.schema import Recipe
from delft.training import distributed as dist
from delft.training.checkpoints import check_data_only
from delft.training.run import Run
from delft.training.setup import build_model, setup

HF_CHECKPOINTS = ".hf"  # under checkpoints/: where transformers writes checkpoint-N before it is renamed


def grpo_rows(recipe: Recipe, tokenizer) -> list[dict]:
    """The training prompts as TRL rows: the rendered prompt, the gold number the rewards read, and the gold
    solution tokenised as delft's SFT tokenises it (the auxiliary term's input)."""
    rows = []
    for ex in load_examples(recipe.data):
        gold = ex.answer if ex.answer is not None else ex.completion
        if parse_number(gold) is None:
            continue
        tok = tokenize_example(ex, tokenizer, recipe.data)
        rows.append({"prompt": render_prompt(ex, tokenizer, recipe.data), "answer": str(gold),
                     "gold_input_ids": tok.input_ids, "gold_labels": tok.labels})
    if not rows:
        raise UserError("no training example has a numeric answer for the GRPO rewards to check", "data.source",
                        "GRPO needs numeric gold answers: gsm8k, svamp, synthetic, reasoning_gym, or an 'answer' "
                        "column.")
    return rows


def reward_setup(recipe: Recipe) -> tuple[list, list[float], str]:
    """(TRL reward functions, their weights, how TRL combines them) for grpo.reward and grpo.reward_functions."""
    g = recipe.grpo
    funcs, weights = [exact_reward], [1.0]
    if g.reward == "partial":
        funcs.append(digit_reward)
        weights.append(g.partial_alpha)
    form = NumberForm.of(recipe.data.numbers)
    if form.active:  # the model answers reversed or prefixed: read back as eval does
        funcs = [read_back(f, form.read_completion) for f in funcs]
    for spec in g.reward_functions:
        funcs.append(_import_reward(spec))
        weights.append(1.0)
    # each reward normalised within its group, then weighted: the digit share cannot outweigh correctness
    aggregation = "normalize_then_sum" if len(funcs) > 1 else "sum_then_normalize"
    return funcs, weights, aggregation


def _import_reward(spec: str):
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"grpo.reward_functions: cannot import {spec!r} ({e})", "grpo.reward_functions",
                        "Give 'module:function' of a TRL reward function on the Python path.") from None
    if not callable(fn):
        raise UserError(f"grpo.reward_functions: {spec!r} is not a function", "grpo.reward_functions",
                        "Give 'module:function'.")
    _check_reward_signature(spec, fn)
    return fn


# The keyword arguments TRL 1.16's GRPOTrainer passes every reward function: its own, grpo_rows' columns (all but
# "prompt"), and trainer_state, log_extra, log_metric.
REWARD_KWARGS = ("prompts", "completions", "completion_ids", "answer", "gold_input_ids", "gold_labels",
                 "trainer_state", "log_extra", "log_metric")


def _check_reward_signature(spec: str, fn) -> None:
    """A function that cannot take TRL's call is refused now, not with a TypeError after the model has loaded and
    the first completions were sampled."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(**dict.fromkeys(REWARD_KWARGS))
    except TypeError as e:
        raise UserError(f"{spec!r} has the signature {signature}, which cannot take TRL's "
                        f"call ({e}): TRL passes the keyword arguments {', '.join(REWARD_KWARGS)}",
                        "grpo.reward_functions", "Define it as def reward(completions, **kwargs) -> list[float] "
                        "(one reward per completion; read what you need from kwargs).") from None


def total_steps(recipe: Recipe, n_rows: int) -> int:
    t = recipe.train
    if t.max_steps is not None:
        return t.max_steps
    return max(1, math.ceil(t.epochs * n_rows / (t.batch_size * t.grad_accum)))


def grpo_config(recipe: Recipe, run_dir: Path, steps: int, device: str, funcs_weights: tuple):
    """TRL's GRPOConfig from the recipe: train.batch_size prompts per micro-step, each sampled num_generations
    times; on the CPU fp32, no vLLM and no gradient checkpointing (TRL's settings that work there)."""
    from trl import GRPOConfig

    t, g = recipe.train, recipe.grpo
    _, weights, aggregation = funcs_weights
    cpu = device == "cpu"
    return GRPOConfig(
        output_dir=str(rundir.checkpoints_root(run_dir) / HF_CHECKPOINTS), per_device_train_batch_size=t.batch_size *
        g.num_generations, gradient_accumulation_steps=t.grad_accum, num_generations=g.num_generations,
        max_completion_length=g.max_completion_length, temperature=g.temperature, beta=g.beta,
        learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler, warmup_steps=int(t.warmup_ratio * steps),
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm if t.max_grad_norm > 0 else 1e9, max_steps=steps,
        seed=t.seed, data_seed=t.seed, logging_steps=t.logging_steps, save_strategy="steps", save_steps=t.save_steps,
        save_total_limit=None, report_to=[], disable_tqdm=True, bf16=not cpu and recipe.model.dtype != "float32",
        use_cpu=cpu, gradient_checkpointing=t.gradient_checkpointing and not cpu, **vllm_settings(cpu),
        reward_weights=weights, multi_objective_aggregation=aggregation, remove_unused_columns=False,
        log_completions=False)


def vllm_settings(cpu: bool) -> dict:
    """vLLM generates the samples on CUDA when it is installed, in the training process (TRL's colocate mode);
    never on the CPU. Not run in delft's tests (no GPU there): docs/grpo.md#on-cuda."""
    if cpu:
        return {"use_vllm": False}
    if importlib.util.find_spec("vllm") is None:
        return {"use_vllm": False}
    return {"use_vllm": True, "vllm_mode": "colocate"}


class RunDirCallback:
    """delft's side of TRL's loop: a metrics.jsonl line and the live line at each log (the last step's too,
    whatever train.logging_steps says, as the SFT loop logs it), checkpoints renamed into place and rotated, the run
    info's step, and a recorded Ctrl-C / SIGTERM ending the run at the next step's end. transformers takes it as a
    TrainerCallback (``trainer_callback``)."""

    def __init__(self, run: Run, keep: int, loss_type: str):
        self.run, self.keep, self.loss_type = run, keep, loss_type
        self.started, self.last = time.perf_counter(), (time.perf_counter(), 0)
        self.first_step: Optional[int] = None  # the step before the first logged one (a resumed run's checkpoint)

    def on_step_end(self, args, state, control, **kwargs):
        if kwargs.get("model") is not None:  # the step generated its samples: an nf4 layer must not be repacked
            check_nf4_exact(kwargs["model"])
        if self.run.stops.received is not None:
            control.should_save, control.should_training_stop = True, True
        if state.global_step >= state.max_steps:  # transformers logs on multiples of logging_steps alone
            control.should_log = True
        return control

    def on_save(self, args, state, control, **kwargs):
        src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if src.is_dir():
            dest = rundir.checkpoint_path(self.run.dir, state.global_step)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(src, dest)  # whole, or not there: resume never reads a half-written checkpoint
            for old in rundir.checkpoints(self.run.dir)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            self.run.record(state.global_step, None)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return control
        row = metrics_row(state.global_step, logs, self._rate(state, logs))
        self.run.log(row)
        self.run.console.print(self.line(row, state), highlight=False)
        return control

    def _rate(self, state, logs) -> float:
        now, tokens = time.perf_counter(), float(logs.get("num_tokens", 0))
        t0, n0 = self.last
        self.last = (now, tokens)
        return (tokens - n0) / max(now - t0, 1e-9)

    def line(self, row: dict, state) -> str:
        if self.first_step is None:
            self.first_step = state.global_step - 1
        done = max(1, state.global_step - self.first_step)
        eta = (time.perf_counter() - self.started) / done * (state.max_steps - state.global_step)
        term = f" {self.loss_type.upper()} {row['term']:.4f}" if LOSS_TYPES[self.loss_type].has_term else ""
        aux = f"  aux CE {row['ce']:.4f}{term} mu {row['mu']:.2f}" if row.get("mu") else ""
        return (f"step {state.global_step:>5}/{state.max_steps}  loss {row['loss']:.4f}  reward {row['reward']:.3f} "
                f"± {row['reward_std']:.3f}  exact {row.get('reward_exact', 0):.2f}{aux}  "
                f"{row['tokens_per_s']:,.0f} tok/s  ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")


@functools.cache
def trainer_callback() -> type:
    """RunDirCallback on transformers' TrainerCallback (which gives the events it leaves alone), made on first use:
    transformers loads torch, which the cheap checks of ``delft train`` run before."""
    from transformers import TrainerCallback

    return type("RunDirCallback", (RunDirCallback, TrainerCallback), {})


def metrics_row(step: int, logs: dict, tokens_per_s: float) -> dict:
    """One metrics.jsonl row of a GRPO step: delft's names for TRL's logs (loss, ce and term of the auxiliary
    term, rewards, the advantage spread, KL, completion length, learning rate, tokens/s)."""
    row = {"step": step, "loss": logs["loss"], "ce": logs.get("aux/ce", 0.0), "term": logs.get("aux/digit_term", 0.0),
           "mu": logs.get("aux/mu", 0.0), "reward": logs.get("reward"), "reward_std": logs.get("reward_std"),
           "advantage_abs": logs.get("advantages/abs_mean"), "kl": logs.get("kl"),
           "completion_length": logs.get("completions/mean_length"), "lr": logs.get("learning_rate"),
           "grad_norm": logs.get("grad_norm"), "tokens_per_s": tokens_per_s}
    for key, value in logs.items():
        if key.startswith("rewards/") and key.endswith("/mean"):
            row[f"reward_{key.split('/')[1]}"] = value
    return row


def check(recipe: Recipe) -> None:
    """What GRPO refuses before the lock is taken and any model loads: more than one process, TRL missing, a
    reward function that does not import or cannot take TRL's call."""
    if dist.world_size() > 1:
        raise UserError("train.stage grpo runs in one process here", "train.stage",
                        "Drop --nproc / torchrun for GRPO (TRL's multi-GPU GRPO goes through accelerate).")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise UserError("train.stage grpo runs TRL's GRPOTrainer, and trl is not installed", "train.stage",
                        'Install it: pip install "delft-digits[trl]" (TRL 1.16).') from None
    reward_setup(recipe)


def load(recipe: Recipe, run: Run) -> "GRPOStage":
    """The GRPO stage of ``run``: model (with LoRA, or the adapter it continues), rows, rewards and TRL's trainer,
    built before anything in the run directory changes; a resumed checkpoint's torch files read as data first."""
    if run.ckpt is not None:
        check_data_only(run.ckpt)  # before truncating metrics or touching the run: a planted file changes nothing
    return GRPOStage(recipe, run)


class GRPOStage:
    """TRL's GRPO loop as the run lifecycle drives a stage (delft.training.run.StageTrainer)."""

    what = "adapter"  # GRPO trains a LoRA policy (the recipe refuses full fine-tuning)
    loss_path = None  # the auxiliary term is delft's loss module, not the SFT loop's CE paths

    def __init__(self, recipe: Recipe, run: Run):
        self.run = run
        self.setup = setup(recipe)
        self.model, _, self.kernels = build_model(self.setup, run.console)
        rows = grpo_rows(recipe, self.setup.tokenizer)
        self.total_steps = total_steps(recipe, len(rows))
        self.trainer = build_trainer(recipe, run, self.setup, self.model, rows, self.total_steps)
        self.resumed = 0  # the checkpoint's step, until TRL's loop runs

    @property
    def step(self) -> int:
        return max(self.trainer.state.global_step, self.resumed)

    def open(self, ckpt: Optional[Path]) -> None:
        """TRL's loop loads the checkpoint itself (``train``); its checkpoints go under checkpoints/."""
        self.resumed = rundir.checkpoint_step(ckpt) if ckpt is not None else 0
        rundir.checkpoints_root(self.run.dir).mkdir(parents=True, exist_ok=True)

    def train(self) -> None:
        ckpt = self.run.ckpt
        self.trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)

    def save_checkpoint(self) -> Optional[Path]:
        """None: TRL saves the step a signal stops the loop on and the last step (the lifecycle finds them), and
        before its first step there is nothing to save."""
        return None

    def write_final(self, tmp: Path) -> None:
        self.trainer.model.save_pretrained(tmp)
        self.setup.tokenizer.save_pretrained(tmp)

    def write_final_elsewhere(self) -> None:
        """Nothing: TRL's ranks other than 0 have no part in the final files."""

    def end(self) -> tuple[dict, list[Path]]:
        return {}, []


def build_trainer(recipe: Recipe, run: Run, s, model, rows: list[dict], steps: int):
    """The DigitGRPOTrainer of ``rows``, with the rewards, the config and RunDirCallback, said in one line."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from delft.integrations.grpo import DigitGRPOTrainer  # TRL (and torch) at import: loaded once a run builds it

    rewards = reward_setup(recipe)
    args = grpo_config(recipe, run.dir, steps, s.device, rewards)
    loss = recipe.loss
    callback = trainer_callback()(run, recipe.train.keep_checkpoints, loss.type)
    trainer = DigitGRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=s.tokenizer, reward_funcs=rewards[0], callbacks=[callback],
                               digit_loss=aux_loss_options(loss),
                               aux_mu=recipe.grpo.aux_mu, aux_mu_end=recipe.grpo.aux_mu_end)
    trainer.remove_callback(PrinterCallback)  # delft prints its own line per logged step
    g = recipe.grpo
    run.console.print(
        f"[bold]grpo[/] {len(rows)} prompts, {steps} steps x {recipe.train.grad_accum} micro-steps of "
        f"{recipe.train.batch_size} prompts x {g.num_generations} samples (<= {g.max_completion_length} tokens, "
        f"temperature {g.temperature:g}); reward {g.reward}"
        + (f" + {len(g.reward_functions)} of yours" if g.reward_functions else "")
        + (f"; auxiliary mu {g.aux_mu:g}" + (f" -> {g.aux_mu_end:g}" if g.aux_mu_end is not None else "")
           + f" x (CE + {loss.weight:g} x {loss.type})" if g.aux_mu or g.aux_mu_end else ""))
    return trainer


def aux_loss_options(loss) -> dict:
    """The recipe's loss section as DigitLoss options (the type's own, such as dist2's tau, only for that type),
    normalised globally: the auxiliary term is a mean over the whole gold batch."""
    return {"type": loss.type, "weight": loss.weight, "place_weights": loss.place_weights,
            "place_weight_cap": loss.place_weight_cap, **{p: getattr(loss, p) for p in LOSS_TYPES[loss.type].params}}
