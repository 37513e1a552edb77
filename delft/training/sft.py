"""The SFT stage (train.stage sft): recipe -> QLoRA adapter (or, fully fine-tuned, a model), with checkpoints,
exact resume and a live display, inside the run lifecycle every stage shares (delft.training.run: the lock, the run
directory, its info and metrics, the final save, the stopped exit).

A plain loop rather than HF Trainer, because delft's loss needs the whole optimizer batch's counts before
the first micro-batch (so CE and the digit term are each a mean over the optimizer batch, independent of
how it is split into micro-batches) and works from hidden states, never full-vocabulary logits.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from delft import rundir
from delft.data.batches import collate, collate_packed
from delft.errors import UserError
from delft.evaluation.metrics import DIGIT_ACCURACY, EXACT_MATCH
from delft.models.context import check_model_max_length
from delft.models.loading import resolve_device, save_initial_adapter
from delft.outputs import follow_umask, no_space_is_a_user_error, staged
from delft.recipe.model_section import MUTATING_INITS
from delft.recipe.schema import Recipe
from delft.training import distributed as dist
from delft.training.checkpoints import AGAIN, check_free_space, final_bytes, rng_states
from delft.training.early_stopping import BEST_DIR, BEST_INFO, EarlyStopping
from delft.training.heldout import HeldOut
from delft.training.loggers import Reporters
from delft.training.neftune import add_neftune
from delft.training.progress import ProgressLines
from delft.training.report import loss_stats, peak_memory_gb
from delft.training.placement import Unreadable, local_value
from delft.training.run import Run
from delft.training.schedule import check_snapshot_steps, make_schedule, micro_batch_items
from delft.training.setup import Setup, build_model, build_optimizer, build_scheduler, describe, setup
from delft.training.step import evaluate_loss, optimizer_step

INITIAL_ADAPTER = "initial_adapter"  # lora.init pissa/olora: the init, for the conversion at save time


def load(recipe: Recipe, run: Run) -> "Trainer":
    """The run's data, model and Trainer, read before anything in the run directory changes."""
    random.seed(recipe.train.seed)
    run.placement.check_launch(recipe, resolve_device(recipe.model.device))
    s = setup(recipe)
    check_snapshot_steps(recipe, make_schedule(recipe, len(s.train), dist.world_size()).total_steps)
    model, dtype, kernels = build_model(s, run.console, run.placement.weights_dtype(recipe, s.device))
    if not s.model_ref.is_local:  # a local config.json was read before loading (precheck or setup)
        check_model_max_length(recipe.data.max_length, model, recipe.model.name)
    describe(s, model, dtype, run.console)
    return Trainer(s, model, dtype, kernels, run)


class Trainer:
    """One run's optimizer and schedule, and the loop that steps, logs, validates and saves: what the SFT stage
    gives the run lifecycle (delft.training.run.StageTrainer)."""

    what = "adapter"  # the final files: "model" when fully fine-tuned

    def __init__(self, s: Setup, model, dtype, kernels: list[str], run: Run):
        t = s.recipe.train
        self.setup, self.model, self.kernels, self.run, self.console = s, model, kernels, run, run.console
        self.recipe, self.loss = s.recipe, s.loss
        self.schedule = make_schedule(s.recipe, len(s.train), dist.world_size())
        self.total_steps = self.schedule.total_steps
        self.placement = run.placement(model, s.loss, s.recipe, s.device)  # whole weights or sharded
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(s, self.params, dtype)
        self.scheduler = build_scheduler(s.recipe, self.optimizer, self.schedule.warmup_steps, self.total_steps)
        if t.neftune_alpha:
            add_neftune(model, t.neftune_alpha)
        if t.finetuning == "full":
            self.what = "model"
        self.step = 0
        self.step_rng: Optional[dict] = None  # RNG states at the start of a step under way (None between steps)
        mutating = t.finetuning == "lora" and not s.recipe.model.adapter and s.recipe.lora.init in MUTATING_INITS
        self.initial_adapter = run.dir / INITIAL_ADAPTER if mutating else None
        self.early_stopping = EarlyStopping.from_recipe(s.recipe)  # early stopping / keep_best; None: neither is set
        self.stopped_at: Optional[int] = None
        self.final_from_best = False  # the final files are best/'s (keep_best), not the last step's
        self.reporters = None  # delft.training.loggers.Reporters once the run directory is open (train.report_to)
        self.heldout = HeldOut.from_recipe(s.recipe, s.tokenizer, run.console) if t.accuracy_steps else None

    @property
    def loss_path(self) -> str:
        return self.loss.path_ran

    # -- run directory

    def open(self, ckpt: Optional[Path]) -> None:
        """The loop's part of opening the run directory: the pissa/olora init kept, the checkpoint loaded on every
        rank with the CE paths the earlier run took, the loggers of train.report_to started. Rank 0 alone writes."""
        if self.initial_adapter is not None and dist.is_main():  # before a checkpoint loads: rebuilt the same way
            with staged(self.initial_adapter) as tmp:
                save_initial_adapter(self.model, tmp)
        if ckpt is not None:
            self.step = self.resume_from(ckpt)
        if not dist.is_main():
            return
        if ckpt is not None:
            earlier = rundir.read_info(self.run.dir).get("loss_path")  # a resumed run may change paths
            self.loss.ran.update(earlier.split("+") if earlier else ())
        if self.recipe.train.report_to:
            self.reporters = Reporters(self.recipe.train.report_to, self.run.dir, self.recipe.to_dict(),
                                       self.run.dir.name)

    def resume_from(self, ckpt: Path) -> int:
        """The newest checkpoint from ``ckpt`` back that loads (a damaged one is said and the next older tried, on
        every rank alike); its step. Rank 0 also restores early stopping."""
        step = rundir.checkpoint_step(ckpt)
        older = [c for c in reversed(rundir.checkpoints(self.run.dir)) if rundir.checkpoint_step(c) < step]
        for candidate in [ckpt, *older]:
            try:
                step, extra = self.placement.load(candidate, self.optimizer, self.scheduler)
            except Unreadable as e:
                self.console.print(f"[yellow]checkpoint {candidate} cannot be read ({str(e).splitlines()[0][:200]}); "
                                   "trying an older one[/]")
                continue
            if self.early_stopping is not None and dist.is_main():
                self.early_stopping.load(extra.get("tracker"))
            return step
        raise UserError(f"no checkpoint in {rundir.checkpoints_root(self.run.dir)} can be read", "output.dir",
                        "Pass --force to start the run over.")

    def save_checkpoint(self) -> Optional[Path]:
        """A checkpoint of the last whole step (None on a rank that does not get its path). Early stopping's state
        goes with it under the key "tracker", as checkpoints have always stored it."""
        state = self.early_stopping.state() if self.early_stopping else None
        return self.placement.save(self.run.dir, self.optimizer, self.scheduler, self.step,
                                   self.recipe.train.keep_checkpoints, self.step_rng, {"tracker": state})

    def save(self) -> None:
        """A checkpoint on train.save_steps, and the run info's step with it."""
        if self.save_checkpoint() is not None:
            self.run.record(self.step, self.loss_path)

    # -- steps

    def batch(self, index: int) -> dict:
        items = micro_batch_items(self.setup.train, self.recipe, self.schedule, index)
        pad_id = self.setup.tokenizer.pad_token_id
        if self.recipe.data.packing:
            return collate_packed(items, pad_id, self.recipe.data.max_length)
        return collate(items, pad_id)

    def train_step(self) -> tuple[dict, float]:
        """One optimizer step: (Loss.means of it, gradient norm before clipping)."""
        t = self.recipe.train
        self.step_rng = rng_states()  # an interrupt before the step commits resumes from exactly here
        batches = [self.batch(i) for i in dist.micro_indices(self.step, t.grad_accum)]
        dist.seed_step(t.seed, self.step)
        out = optimizer_step(self.placement.module, batches, self.loss, self.setup.device)
        self.placement.reduce_gradients(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
        grad_norm = local_value(grad_norm)  # a DTensor when the gradients are sharded
        with self.run.stops.atomic():
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.step_rng = None
        if not math.isfinite(out["loss"]):
            raise UserError(f"the loss became {out['loss']} at step {self.step}", "train.learning_rate",
                            "Lower train.learning_rate or use dtype float32; the last checkpoint is kept.")
        return out, grad_norm

    def _append_metrics(self, row: dict) -> None:
        """A metrics.jsonl line (the run's, rank 0), also to the loggers of train.report_to."""
        self.run.log(row)
        if self.reporters is not None and dist.is_main():
            self.reporters.log(row)

    def log(self, out: dict, grad_norm: float, tokens_per_s: float, stats: str) -> None:
        row = {"step": self.step, "loss": out["loss"], "ce": out["ce"], "term": out["term"],
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "peak_mem_gb": peak_memory_gb(self.setup.device), "digit_logit": out.get("digit_logit"),
               "p_digit": out.get("p_digit")}
        self._append_metrics(row)
        self.console.print(f"step {self.step:>5}/{self.schedule.total_steps}  {stats}  lr {row['lr']:.2e}  "
                           f"{tokens_per_s:,.0f} tok/s  peak {row['peak_mem_gb']:.2f} GB", highlight=False)

    def validate(self) -> Optional[float]:
        """The validation loss (logged and shown) on rank 0; None on the others. The ranks the placement involves
        compute it (whole weights: rank 0 alone, the others wait at the next step; sharded: every rank)."""
        if not self.placement.involved():
            return None
        ev = evaluate_loss(self.placement.module, self.setup.val, self.loss,
                           self.recipe.train.batch_size, self.setup.tokenizer.pad_token_id, self.setup.device)
        if not dist.is_main():
            return None
        self._append_metrics({"step": self.step, **ev})
        stats = loss_stats(self.recipe.loss.type, ev["val_loss"], ev["val_ce"], ev["val_term"])
        self.console.print(f"step {self.step:>5}  validation {stats}", highlight=False)
        return ev["val_loss"]

    def measure_accuracy(self) -> Optional[float]:
        """Greedy exact match on the held-out slice (delft.training.heldout), logged and shown by rank 0 (None on
        the others); who computes it as for validation."""
        if not self.placement.involved():
            return None
        with self.placement.gathered():  # sharded: every rank generates alike, with the weights gathered
            measured = self.heldout.measure(self.model)
        if not dist.is_main():
            return None
        row = {"step": self.step, **measured}
        self._append_metrics(row)
        exact, digits = row[EXACT_MATCH.heldout], row[DIGIT_ACCURACY.heldout]
        self.console.print(f"step {self.step:>5}  held-out exact match {100 * exact:.1f} % of "
                           f"{row['accuracy_n']}  (digits {100 * (digits or 0):.1f} %)", highlight=False)
        return exact

    # -- the loop

    def train(self) -> None:
        """Step to the end (or to early stopping) with a live display. Ctrl-C or SIGTERM raises KeyboardInterrupt
        out of it (the run lifecycle saves the last whole step); inside a step's commit it waits for its end."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        t, total = self.recipe.train, self.schedule.total_steps
        self.console.print(f"[bold]training[/] {total} steps x {t.grad_accum} micro-batches of {t.batch_size} "
                           f"{dist.describe()}{self.placement.describe()}"
                           f"({self.schedule.micro_per_epoch} micro-batches per epoch), "
                           f"run directory {self.run.dir}")
        if self.setup.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        window_tokens, window_start = 0, time.perf_counter()
        with Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=self.console, transient=True) as progress:  # a stop ends the display first
            task = progress.add_task("train", total=total, completed=self.step, stats="")
            lines = ProgressLines(self.console, total, self.step, dist.is_main())  # a log file's progress
            while self.step < total:
                out, grad_norm = self.train_step()
                window_tokens += out["tokens"]
                rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                stats = loss_stats(self.recipe.loss.type, out["loss"], out["ce"], out["term"])
                if out.get("p_digit") is not None:  # the shift of the raw digit logits and P(correct digit)
                    stats += f"  digit logit {out['digit_logit']:+.1f}  P(digit) {out['p_digit']:.2f}"
                progress.update(task, completed=self.step, stats=f"{stats}  {rate:,.0f} tok/s  "
                                                                 f"peak {peak_memory_gb(self.setup.device):.2f} GB")
                lines.step(self.step, out["tokens"])
                logged, stop = self.after_step(out, grad_norm, rate, stats)
                self.placement.agree_on_signal(self.run.stops)  # sharded: the ranks stop together, here
                if logged:
                    window_tokens, window_start = 0, time.perf_counter()
                if stop:
                    self.stopped_at = self.step
                    if dist.is_main():
                        self.console.print(f"[yellow]early stopping[/] at step {self.step}: "
                                           f"{self.early_stopping.summary(self.step)['stopped_early']['why']}")
                    break

    def after_step(self, out: dict, grad_norm: float, rate: float, stats: str) -> tuple[bool, bool]:
        """Log, validate, measure, save and snapshot as this step asks: (logged, early stopping ends the run)."""
        t, last = self.recipe.train, self.step == self.schedule.total_steps
        logged = self.step % t.logging_steps == 0 or last
        if logged:
            self.log(out, grad_norm, rate, stats)
        measured = {}
        if self.setup.val and (self.step % t.eval_steps == 0 or last):
            measured["val_loss"] = self.validate()
        if self.heldout is not None and (self.step % t.accuracy_steps == 0 or last):
            measured["heldout_accuracy"] = self.measure_accuracy()
        stop = self.track(measured) and not last
        if self.step % t.save_steps == 0 and not last and not stop:
            self.save()
        if self.step in t.snapshot_steps:
            self.snapshot()
        return logged, stop

    def track(self, measured: dict) -> bool:
        """Feed the tracked metric to early stopping / keep_best (rank 0 measures; every rank learns whether to stop)."""
        stopping = self.early_stopping
        if stopping is None or stopping.metric not in measured:
            return False
        improved = self.placement.from_main(dist.is_main() and stopping.update(measured[stopping.metric], self.step))
        if improved and self.recipe.train.keep_best:
            self.save_best()
        stop = dist.is_main() and stopping.should_stop
        return bool(dist.all_reduce_floats([float(stop)])[0])

    def save_best(self) -> None:
        """The best step's model (or adapter) in best/, replacing the earlier best, with its step."""
        info = {"step": self.step, "metric": self.early_stopping.metric, "value": self.early_stopping.best}
        self.write_model_dir(self.run.dir / BEST_DIR, "best model",
                             lambda tmp: (tmp / BEST_INFO).write_text(json.dumps(info)))

    def best_dir(self) -> Optional[Path]:
        """best/ when keep_best wrote it for the step early stopping holds as best (else None: the last model is
        used)."""
        path = self.run.dir / BEST_DIR
        if not self.recipe.train.keep_best or not (path / BEST_INFO).is_file():
            return None
        return path if json.loads((path / BEST_INFO).read_text())["step"] == self.early_stopping.best_step else None

    def save_model(self, path: Path) -> None:
        """The model or adapter as a user loads it: a pissa/olora adapter converted to apply to the original base
        (its checkpoints stay unconverted: a resume rebuilds the same mutated base). ``path`` None: a rank that only
        helps gather (sharded; see ``write_model_dir``)."""
        self.placement.save_pretrained(self.model, path, self.initial_adapter)

    def snapshot(self) -> None:
        """The model (or adapter) and tokenizer as they are now, kept in snapshots/step-N (learning curves)."""
        path = rundir.snapshot_path(self.run.dir, self.step)
        if path.is_dir() or not self.placement.involved():  # a resumed run keeps the one it wrote
            return
        self.write_model_dir(path, "snapshot", self.setup.tokenizer.save_pretrained)

    def write_model_dir(self, path: Path, what: str, also) -> None:
        """The model (or adapter) as ``save_model`` writes it, plus what ``also(tmp)`` adds, into ``path`` whole
        (staged; the free space checked first). Sharded, every rank calls it and the others only help gather."""
        if not dist.is_main():
            self.save_model(None)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(path.parent, final_bytes(self.model, self.setup.tokenizer), what)
        with staged(path) as tmp, no_space_is_a_user_error(path, "output.dir", AGAIN, partial=tmp):
            self.save_model(tmp)
            also(tmp)
            follow_umask(tmp)

    # -- the end

    def write_final(self, tmp: Path) -> None:
        """The final model (or adapter) and tokenizer into ``tmp``: PeftModel.from_pretrained(run_dir) (or
        AutoModelForCausalLM.from_pretrained(run_dir)) loads them once the lifecycle moves them into place."""
        if self.what == "model":
            self.model.config.use_cache = True  # as a loaded model expects (training turned it off)
        best = self.best_dir()
        self.final_from_best = self.placement.from_main(best is not None)  # the others gather only without it
        if best is not None:  # keep_best: the best step's files, not the last step's
            shutil.copytree(best, tmp, ignore=shutil.ignore_patterns(BEST_INFO))
        else:
            self.save_model(tmp)
        self.setup.tokenizer.save_pretrained(tmp)

    def write_final_elsewhere(self) -> None:
        """What the ranks other than 0 do while rank 0 writes the final files: a sharded run's take part in
        gathering the model, unless rank 0 copies keep_best's best/ instead."""
        if not self.placement.from_main(False):
            self.save_model(None)

    def end(self) -> tuple[dict, list[Path]]:
        """Once the final files are in place: (what the run info adds: the best step and an early stop, what is
        removed with the checkpoints: best/ and the pissa/olora init). The loggers of train.report_to close."""
        if self.reporters is not None:
            self.reporters.close(self.run.dir / rundir.LOSS_CURVE)
        stopping = self.early_stopping
        info = stopping.summary(self.stopped_at) if stopping is not None and stopping.best_step else {}
        if info and self.recipe.train.keep_best:
            info["best"]["written"] = self.final_from_best  # False: best/ was lost (a shortened resume); the last is
        leftovers = [self.run.dir / BEST_DIR] + ([self.initial_adapter] if self.initial_adapter is not None else [])
        return info, leftovers
