"""``delft train`` with ``train.stage: grpo``: reinforcement learning from verifiable numeric rewards, run by TRL's
GRPOTrainer (delft.integrations.grpo.DigitGRPOTrainer: the auxiliary digit term on the gold solutions), inside
delft's run directory contract.

The contract is the SFT stage's: the run lock, ``recipe.yaml``, ``delft_run.json``, ``metrics.jsonl``, checkpoints
under ``checkpoints/step-NNNNNN`` (transformers' own checkpoint, renamed into place once whole, so a half-written
one is never resumed), exact resume, Ctrl-C / SIGTERM ending the step in flight and saving, a live line per logged
step, and at the end the adapter and tokenizer at the top of the run directory, so eval, inspect, export, compare
and study take a GRPO run as they take an SFT run. TRL's own loop runs the steps (generation, rewards, advantages,
the clipped objective); delft's pieces are callbacks around it.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft import rundir
from delft.errors import UserError
from delft.outputs import append_line, follow_umask, write_atomic
from delft.recipe.schema import Recipe
from delft.recipe.files import dump_recipe
from delft.training.checkpoints import AGAIN, check_data_only

HF_CHECKPOINTS = ".hf"  # under checkpoints/: where transformers writes checkpoint-N before it is renamed


def grpo_rows(recipe: Recipe, tokenizer) -> list[dict]:
    """The training prompts as TRL rows: the rendered prompt, the gold number the rewards read, and the gold
    solution tokenised as delft's SFT tokenises it (the auxiliary term's input)."""
    from delft.data.pipeline import load_examples
    from delft.data.prompts import render_prompt
    from delft.data.batches import tokenize_example
    from delft.numbers.answers import parse_number

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
    from delft.numbers.rewards import digit_reward, exact_reward

    g = recipe.grpo
    funcs, weights = [exact_reward], [1.0]
    if g.reward == "partial":
        funcs.append(digit_reward)
        weights.append(g.partial_alpha)
    for spec in g.reward_functions:
        funcs.append(_import_reward(spec))
        weights.append(1.0)
    # each reward normalised within its group, then weighted: the digit share cannot outweigh correctness
    aggregation = "normalize_then_sum" if len(funcs) > 1 else "sum_then_normalize"
    return funcs, weights, aggregation


def _import_reward(spec: str):
    import importlib

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
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"use_vllm": False}
    return {"use_vllm": True, "vllm_mode": "colocate"}


def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class RunDirCallback(_callback_base()):
    """delft's side of TRL's loop: metrics.jsonl and the live line at each log, checkpoints renamed into place and
    rotated, the run info's step, and a recorded Ctrl-C / SIGTERM ending the run at the next step's end."""

    def __init__(self, run_dir: Path, stops, console: Console, keep: int, term_name: str):
        self.run_dir, self.stops, self.console, self.keep, self.term_name = run_dir, stops, console, keep, term_name
        self.started, self.last = time.perf_counter(), (time.perf_counter(), 0)
        self.first_step: Optional[int] = None  # the step before the first logged one (a resumed run's checkpoint)

    def on_step_end(self, args, state, control, **kwargs):
        if self.stops.received is not None:
            control.should_save, control.should_training_stop = True, True
        return control

    def on_save(self, args, state, control, **kwargs):
        src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if src.is_dir():
            dest = rundir.checkpoint_path(self.run_dir, state.global_step)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(src, dest)  # whole, or not there: resume never reads a half-written checkpoint
            for old in rundir.checkpoints(self.run_dir)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            rundir.update_info(self.run_dir, step=state.global_step)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return control
        row = metrics_row(state.global_step, logs, self._rate(state, logs))
        append_line(self.run_dir / rundir.METRICS, json.dumps(row), "output.dir", AGAIN)
        self.console.print(self.line(row, state), highlight=False)
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
        aux = (f"  aux CE {row['ce']:.4f} {self.term_name} {row['term']:.4f} mu {row['mu']:.2f}"
               if row.get("mu") else "")
        return (f"step {state.global_step:>5}/{state.max_steps}  loss {row['loss']:.4f}  reward {row['reward']:.3f} "
                f"± {row['reward_std']:.3f}  exact {row.get('reward_exact', 0):.2f}{aux}  "
                f"{row['tokens_per_s']:,.0f} tok/s  ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")


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


def build_trainer(recipe: Recipe, run_dir: Path, console: Console, stops):
    """(the DigitGRPOTrainer, the setup): model with LoRA (or the adapter it continues), rows, rewards, config."""
    from datasets import Dataset

    from delft.training.grpo_trainer import DigitGRPOTrainer
    from delft.training.setup import build_model, setup

    s = setup(recipe)
    model, _, _ = build_model(s, console)
    rows = grpo_rows(recipe, s.tokenizer)
    steps = total_steps(recipe, len(rows))
    rewards = reward_setup(recipe)
    args = grpo_config(recipe, run_dir, steps, s.device, rewards)
    loss = recipe.loss
    term_name = loss.type.upper() if loss.type != "ce" else "digit"
    callback = RunDirCallback(run_dir, stops, console, recipe.train.keep_checkpoints, term_name)
    trainer = DigitGRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=s.tokenizer, reward_funcs=rewards[0], callbacks=[callback],
                               digit_loss=aux_loss_options(loss),
                               aux_mu=recipe.grpo.aux_mu, aux_mu_end=recipe.grpo.aux_mu_end)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # delft prints its own line per logged step
    g = recipe.grpo
    console.print(f"[bold]grpo[/] {len(rows)} prompts, {steps} steps x {recipe.train.grad_accum} micro-steps of "
                  f"{recipe.train.batch_size} prompts x {g.num_generations} samples (<= {g.max_completion_length} "
                  f"tokens, temperature {g.temperature:g}); reward {g.reward}"
                  + (f" + {len(g.reward_functions)} of yours" if g.reward_functions else "")
                  + (f"; auxiliary mu {g.aux_mu:g}" + (f" -> {g.aux_mu_end:g}" if g.aux_mu_end is not None else "")
                     + f" x (CE + {loss.weight:g} x {loss.type})" if g.aux_mu or g.aux_mu_end else ""))
    return trainer, s, steps


def aux_loss_options(loss) -> dict:
    """The recipe's loss section as DigitLoss options (the type's own, such as dist2's tau, only for that type),
    normalised globally: the auxiliary term is a mean over the whole gold batch."""
    from delft.losses.registry import LOSS_TYPES

    return {"type": loss.type, "weight": loss.weight, "place_weights": loss.place_weights,
            "place_weight_cap": loss.place_weight_cap, **{p: getattr(loss, p) for p in LOSS_TYPES[loss.type].params}}


def start_info(run_dir: Path, recipe: Recipe, s, model, steps: int) -> None:
    from dataclasses import asdict

    write_atomic(run_dir / rundir.RECIPE, dump_recipe(recipe))
    rundir.write_info(run_dir, {
        "status": rundir.RUNNING, "stage": "grpo", "base_model": s.model_ref.portable_name(),
        "base_model_path": s.model_ref.path, "architecture": rundir.architecture(model.get_base_model().config),
        "quantization": s.quantization, "loss": recipe.loss.type, "loss_weight": recipe.loss.weight,
        "step": rundir.read_info(run_dir).get("step", 0), "total_steps": steps, "data": asdict(s.stats),
        "continued_from": recipe.model.adapter, "world_size": 1})


def finish(trainer, s, run_dir: Path, console: Console) -> None:
    """The adapter and tokenizer at the top of the run directory, the run marked completed, checkpoints gone."""
    from delft.training.report import plot_losses

    tmp = run_dir / ".final-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.model.save_pretrained(tmp)
    s.tokenizer.save_pretrained(tmp)
    follow_umask(tmp)
    for f in tmp.iterdir():
        os.replace(f, run_dir / f.name)
    tmp.rmdir()
    metrics = run_dir / rundir.METRICS
    if metrics.is_file():
        plot_losses(metrics, run_dir / rundir.LOSS_CURVE, s.recipe.loss.type)
    rundir.update_info(run_dir, step=trainer.state.global_step, status=rundir.COMPLETED)
    shutil.rmtree(rundir.checkpoints_root(run_dir), ignore_errors=True)
    console.print(f"[bold green]done[/] adapter, tokenizer, metrics.jsonl and loss_curve.png in {run_dir}")


def run_grpo(recipe: Recipe, resume: Optional[bool] = None, force: bool = False,
             console: Optional[Console] = None, resume_command: str = "delft train RECIPE.yaml") -> Path:
    """Train ``recipe`` (train.stage grpo) into its output.dir: fresh, resumed from its last checkpoint, or with
    ``force`` replacing an earlier run; Ctrl-C or SIGTERM saves the last whole step and exits 130 / 143."""
    from delft.training.lock import run_lock
    from delft.training.resume import (
        check_replaceable,
        check_steps_left,
        check_writable,
        checkpoint_step,
        prepare_run_dir,
        truncate_metrics,
    )
    from delft.training.signals import StopSignals

    console = console or Console()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise UserError("train.stage grpo runs TRL's GRPOTrainer, and trl is not installed", "train.stage",
                        'Install it: pip install "delft-digits[trl]" (TRL 1.16).') from None
    reward_setup(recipe)  # imports and checks grpo.reward_functions before the lock is taken and any model loads
    run = Path(recipe.output.dir)
    check_replaceable(run)
    check_writable(run)
    with run_lock(run) as lock:
        run_dir, ckpt, replace = prepare_run_dir(recipe, resume, force, console, lock.stale_pid)
        stops = StopSignals(immediate=False)
        trainer, s, steps = build_trainer(recipe, run_dir, console, stops)
        if ckpt is not None:
            check_steps_left(ckpt, steps)
            check_data_only(ckpt)  # before truncating metrics or touching the run: a planted file changes nothing
        if replace:
            console.print(f"[yellow]--force: replacing {run_dir}[/]")
            rundir.clear(run_dir)  # the directory stays: it holds the lock
        rundir.checkpoints_root(run_dir).mkdir(parents=True, exist_ok=True)
        if ckpt is not None:
            truncate_metrics(run_dir / rundir.METRICS, checkpoint_step(ckpt), console)
        start_info(run_dir, recipe, s, trainer.model, steps)
        with stops:
            trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
        if stops.received is not None:
            step = trainer.state.global_step
            rundir.update_info(run_dir, step=step, status=rundir.INTERRUPTED)
            console.print(f"\n[yellow]{stops.how}.[/] Saved {rundir.checkpoint_path(run_dir, step)} (step {step}/{steps}). "
                          f"Resume with: {resume_command}")
            raise SystemExit(stops.exit_code)
        finish(trainer, s, run_dir, console)
    return run_dir

