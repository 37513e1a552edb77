"""The training loop: recipe -> QLoRA adapter (or, fully fine-tuned, a model), with checkpoints, exact resume and a
live display.

A plain loop rather than HF Trainer, because delft's loss needs the whole optimizer batch's counts before
the first micro-batch (so CE and the digit term are each a mean over the optimizer batch, independent of
how it is split into micro-batches) and works from hidden states, never full-vocabulary logits.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft import rundir, signals
from delft.errors import UserError
from delft.outputs import append_line, follow_umask, no_space_is_a_user_error, staged, write_atomic
from delft.recipe.schema import Recipe
from delft.recipe.files import dump_recipe
from delft.training import distributed as dist
from delft.training.early_stopping import BEST_DIR, BEST_INFO, EarlyStopping
from delft.training.checkpoints import (
    AGAIN,
    adapter_bytes,
    check_free_space,
    load_checkpoint,
    rng_states,
    save_checkpoint,
)
from delft.training.precheck import check_before_loading, note_busy_machine
from delft.training.report import peak_memory_gb, plot_losses
from delft.training.resume import (
    check_replaceable,
    check_steps_left,
    check_writable,
    prepare_run_dir,
    truncate_metrics,
)
from delft.training.schedule import make_schedule, micro_batch_items
from delft.training.setup import Setup, build_model, build_optimizer, build_scheduler, describe, setup
from delft.training.signals import StopSignals
from delft.training.step import evaluate_loss, optimizer_step


FINAL_TMP = ".final-tmp"  # the final files, written whole before they are moved to the top of the run
INITIAL_ADAPTER = "initial_adapter"  # lora.init pissa/olora: the init, for the conversion at save time


class Trainer:
    """One run's optimizer, schedule and run directory, and the loop that steps, logs, validates and saves."""

    def __init__(self, s: Setup, model, dtype, run_dir: Path, console: Console):
        t = s.recipe.train
        self.s, self.model, self.run_dir, self.console = s, model, run_dir, console
        self.recipe, self.loss = s.recipe, s.loss
        self.schedule = make_schedule(s.recipe, len(s.train), dist.world_size())
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(s, self.params, dtype)
        self.scheduler = build_scheduler(s.recipe, self.optimizer, self.schedule.warmup_steps,
                                         self.schedule.total_steps)
        if t.neftune_alpha:
            from delft.training.neftune import add_neftune

            add_neftune(model, t.neftune_alpha)
        self.metrics_path = run_dir / rundir.METRICS
        self.term_name = s.recipe.loss.type.upper() if s.recipe.loss.type != "ce" else "digit"
        self.step = 0
        self.stops = StopSignals()
        self.step_rng: Optional[dict] = None  # RNG states at the start of a step under way (None between steps)
        self.heldout = None  # delft.training.heldout.HeldOut when train.accuracy_steps is set
        from delft.models.loading import MUTATING_INITS

        mutating = t.finetuning == "lora" and not s.recipe.model.adapter and s.recipe.lora.init in MUTATING_INITS
        self.initial_adapter = run_dir / INITIAL_ADAPTER if mutating else None
        self.tracker = EarlyStopping.from_recipe(s.recipe)  # early stopping / keep_best; None when neither is set
        self.stopped_at: Optional[int] = None
        self.reporters = None  # delft.training.loggers.Reporters once the run directory is open (train.report_to)
        if t.report_to:
            from delft.training.loggers import check_backends

            check_backends(t.report_to)
        if t.accuracy_steps:
            from delft.training.heldout import HeldOut

            self.heldout = HeldOut.from_recipe(s.recipe, s.tokenizer, console)

    # -- run directory

    def open_run_dir(self, ckpt: Optional[Path], replace: bool, kernels: list[str]) -> None:
        """Replace (--force) or resume the run directory, only now that model and data have loaded."""
        from delft.models.loading import plain_model
        from delft.rundir import architecture

        if not dist.is_main():  # reads the checkpoint; rank 0 alone writes the run directory
            self.step = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler) if ckpt else 0
            return
        if replace:
            self.console.print(f"[yellow]--force: replacing {self.run_dir}[/]")
            rundir.clear(self.run_dir)  # the directory stays: it holds the lock
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.initial_adapter is not None:  # before a checkpoint loads: the init is rebuilt the same way
            from delft.models.loading import save_initial_adapter

            with staged(self.initial_adapter) as tmp:
                save_initial_adapter(self.model, tmp)
        if ckpt is not None:
            self.step = self.resume_from(ckpt)
            truncate_metrics(self.metrics_path, self.step, self.console)
            earlier = rundir.read_info(self.run_dir).get("loss_path")  # a resumed run may change paths
            self.loss.ran.update(earlier.split("+") if earlier else ())
        write_atomic(self.run_dir / rundir.RECIPE, dump_recipe(self.recipe))
        if self.recipe.train.report_to:
            from delft.training.loggers import Reporters

            self.reporters = Reporters(self.recipe.train.report_to, self.run_dir, self.recipe.to_dict(),
                                       self.run_dir.name)
        s = self.s
        rundir.write_info(self.run_dir, {
            "status": rundir.RUNNING, "base_model": s.model_ref.portable_name(), "base_model_path": s.model_ref.path,
            "architecture": architecture(plain_model(self.model).config), "quantization": s.quantization,
            "finetuning": self.recipe.train.finetuning, "init": self.recipe.model.init,
            "loss": self.recipe.loss.type, "loss_weight": self.recipe.loss.weight, "loss_path": self.loss.path_ran,
            "step": self.step, "total_steps": self.schedule.total_steps, "liger_kernels": kernels,
            "data": asdict(s.stats),
            "world_size": dist.world_size()})

    def resume_from(self, ckpt: Path) -> int:
        """Load ``ckpt``, or the newest older checkpoint that loads when it is damaged (saying so); its step."""
        older = [c for c in reversed(rundir.checkpoints(self.run_dir)) if c.name < ckpt.name]
        for candidate in [ckpt, *older]:
            try:
                extra: dict = {}
                step = load_checkpoint(candidate, self.model, self.optimizer, self.scheduler, extra)
                if self.tracker is not None:
                    self.tracker.load(extra.get("tracker"))
                return step
            except UserError:
                raise
            except Exception as e:  # truncated safetensors, a broken pickle, a missing file: many types
                self.console.print(f"[yellow]checkpoint {candidate} cannot be read ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:120] if str(e) else ''}); trying an older one[/]")
        raise UserError(f"no checkpoint in {rundir.checkpoints_root(self.run_dir)} can be read", "output.dir",
                        "Pass --force to start the run over.")

    def save(self, status: Optional[str] = None) -> Optional[Path]:
        if not dist.is_main():
            return None
        t = self.recipe.train
        path = save_checkpoint(self.run_dir, self.model, self.optimizer, self.scheduler, self.step, t.keep_checkpoints,
                               self.step_rng, extra={"tracker": self.tracker.state() if self.tracker else None})
        rundir.update_info(self.run_dir, step=self.step, loss_path=self.loss.path_ran,
                           **({"status": status} if status else {}))
        return path

    # -- steps

    def batch(self, index: int) -> dict:
        from delft.data.batches import collate, collate_packed

        items = micro_batch_items(self.s.train, self.recipe, self.schedule, index)
        pad_id = self.s.tokenizer.pad_token_id
        if self.recipe.data.packing:
            return collate_packed(items, pad_id, self.recipe.data.max_length)
        return collate(items, pad_id)

    def train_step(self) -> tuple[dict, float]:
        """One optimizer step: (Loss.means of it, gradient norm before clipping)."""
        import torch

        t = self.recipe.train
        self.step_rng = rng_states()  # an interrupt before the step commits resumes from exactly here
        batches = [self.batch(i) for i in dist.micro_indices(self.step, t.grad_accum)]
        dist.seed_step(t.seed, self.step)
        out = optimizer_step(self.model, batches, self.loss, self.s.device)
        dist.all_reduce_grads(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
        with self.stops.atomic():
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.step_rng = None
        if not math.isfinite(out["loss"]):
            raise UserError(f"the loss became {out['loss']} at step {self.step}", "train.learning_rate",
                            "Lower train.learning_rate or use dtype float32; the last checkpoint is kept.")
        return out, float(grad_norm)

    def _append_metrics(self, row: dict) -> None:
        if not dist.is_main():
            return
        append_line(self.metrics_path, json.dumps(row), "output.dir", AGAIN)
        if self.reporters is not None:
            self.reporters.log(row)

    def log(self, out: dict, grad_norm: float, tokens_per_s: float, stats: str) -> None:
        row = {"step": self.step, "loss": out["loss"], "ce": out["ce"], "term": out["term"],
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "peak_mem_gb": peak_memory_gb(self.s.device), "digit_logit": out.get("digit_logit"),
               "p_digit": out.get("p_digit")}
        self._append_metrics(row)
        self.console.print(f"step {self.step:>5}/{self.schedule.total_steps}  {stats}  lr {row['lr']:.2e}  "
                           f"{tokens_per_s:,.0f} tok/s  peak {row['peak_mem_gb']:.2f} GB", highlight=False)

    def validate(self) -> Optional[float]:
        """The validation loss (logged and shown) on rank 0; None on the others."""
        if not dist.is_main():  # validation loss runs on rank 0 alone; the others wait at the next step
            return None
        ev = evaluate_loss(self.model, self.s.val, self.loss, self.recipe.train.batch_size,
                           self.s.tokenizer.pad_token_id, self.s.device)
        self._append_metrics({"step": self.step, **ev})
        self.console.print(f"step {self.step:>5}  validation loss {ev['val_loss']:.4f}  ce {ev['val_ce']:.4f}  "
                           f"{self.term_name} {ev['val_term']:.4f}", highlight=False)
        return ev["val_loss"]

    def measure_accuracy(self) -> Optional[float]:
        """Greedy exact match on the held-out slice (delft.training.heldout), logged and shown; rank 0 alone, like
        validation (None on the others)."""
        if not dist.is_main():
            return None
        row = {"step": self.step, **self.heldout.measure(self.model)}
        self._append_metrics(row)
        self.console.print(f"step {self.step:>5}  held-out exact match {100 * row['accuracy']:.1f} % of "
                           f"{row['accuracy_n']}  (digits {100 * (row['digit_accuracy'] or 0):.1f} %)",
                           highlight=False)
        return row["accuracy"]

    # -- the loop

    def train(self, resume_command: str) -> None:
        """Step to the end with a live display; Ctrl-C (SIGTERM) saves a checkpoint and exits 130 (143)."""
        import torch
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        t, total = self.recipe.train, self.schedule.total_steps
        self.console.print(f"[bold]training[/] {total} steps x {t.grad_accum} micro-batches of {t.batch_size} "
                           f"{dist.describe()}({self.schedule.micro_per_epoch} micro-batches per epoch), "
                           f"run directory {self.run_dir}")
        if self.s.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        window_tokens, window_start = 0, time.perf_counter()
        with Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=self.console, transient=True) as progress, self.stops:
            task = progress.add_task("train", total=total, completed=self.step, stats="")
            try:
                while self.step < total:
                    out, grad_norm = self.train_step()
                    window_tokens += out["tokens"]
                    rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                    stats = f"loss {out['loss']:.4f}  ce {out['ce']:.4f}  {self.term_name} {out['term']:.4f}"
                    if out.get("p_digit") is not None:  # the shift of the raw digit logits and P(correct digit)
                        stats += f"  digit logit {out['digit_logit']:+.1f}  P(digit) {out['p_digit']:.2f}"
                    progress.update(task, completed=self.step, stats=f"{stats}  {rate:,.0f} tok/s  "
                                                                     f"peak {peak_memory_gb(self.s.device):.2f} GB")
                    logged, stop = self.after_step(out, grad_norm, rate, stats)
                    if logged:
                        window_tokens, window_start = 0, time.perf_counter()
                    if stop:
                        self.stopped_at = self.step
                        if dist.is_main():
                            self.console.print(f"[yellow]early stopping[/] at step {self.step}: "
                                               f"{self.tracker.summary(self.step)['stopped_early']['why']}")
                        break
            except KeyboardInterrupt:
                progress.stop()
                self.save_interrupted(resume_command)

    def after_step(self, out: dict, grad_norm: float, rate: float, stats: str) -> tuple[bool, bool]:
        """Log, validate, measure, save and snapshot as this step asks: (logged, early stopping ends the run)."""
        t, last = self.recipe.train, self.step == self.schedule.total_steps
        logged = self.step % t.logging_steps == 0 or last
        if logged:
            self.log(out, grad_norm, rate, stats)
        measured = {}
        if self.s.val and (self.step % t.eval_steps == 0 or last):
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
        if self.tracker is None or self.tracker.metric not in measured:
            return False
        if dist.is_main() and self.tracker.update(measured[self.tracker.metric], self.step) \
                and self.recipe.train.keep_best:
            self.save_best()
        stop = dist.is_main() and self.tracker.should_stop
        return bool(dist.all_reduce_floats([float(stop)])[0])

    def save_best(self) -> None:
        """The best step's model (or adapter) in best/, replacing the earlier best, with its step."""
        info = {"step": self.step, "metric": self.tracker.metric, "value": self.tracker.best}
        self.write_model_dir(self.run_dir / BEST_DIR, "best model",
                             lambda tmp: (tmp / BEST_INFO).write_text(json.dumps(info)))

    def best_dir(self) -> Optional[Path]:
        """best/ when keep_best wrote it for the step the tracker holds as best (else None: the last model is used)."""
        path = self.run_dir / BEST_DIR
        if not self.recipe.train.keep_best or not (path / BEST_INFO).is_file():
            return None
        return path if json.loads((path / BEST_INFO).read_text())["step"] == self.tracker.best_step else None

    def save_model(self, path: Path) -> None:
        """The model or adapter as a user loads it: a pissa/olora adapter converted to apply to the original base
        (its checkpoints stay unconverted: a resume rebuilds the same mutated base)."""
        if self.initial_adapter is None:
            self.model.save_pretrained(path)
        else:
            self.model.save_pretrained(path, path_initial_model_for_weight_conversion=str(self.initial_adapter))

    def snapshot(self) -> None:
        """The model (or adapter) and tokenizer as they are now, kept in snapshots/step-N (learning curves)."""
        path = rundir.snapshot_path(self.run_dir, self.step)
        if not dist.is_main() or path.is_dir():  # a resumed run keeps the one it wrote before
            return
        self.write_model_dir(path, "snapshot", self.s.tokenizer.save_pretrained)

    def write_model_dir(self, path: Path, what: str, also) -> None:
        """The model (or adapter) as ``save_model`` writes it, plus what ``also(tmp)`` adds, into ``path`` whole
        (staged; the free space checked first)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(path.parent, adapter_bytes(self.model) + 2**24, what)
        with staged(path) as tmp, no_space_is_a_user_error(path, "output.dir", AGAIN, partial=tmp):
            self.save_model(tmp)
            also(tmp)
            follow_umask(tmp)

    def save_interrupted(self, resume_command: str) -> None:
        """After Ctrl-C or SIGTERM: a checkpoint of the last whole step (kept when it exists), then exit."""
        path = rundir.checkpoint_path(self.run_dir, self.step)
        if path in rundir.checkpoints(self.run_dir):
            rundir.update_info(self.run_dir, step=self.step, status=rundir.INTERRUPTED, loss_path=self.loss.path_ran)
        else:
            path = self.save(rundir.INTERRUPTED)
        self.console.print(f"\n[yellow]{self.stops.how}.[/] Saved {path} (step {self.step}/{self.schedule.total_steps}). "
                           f"Resume with: {resume_command}")
        raise SystemExit(self.stops.exit_code)

    def finish(self, resume_command: str = "delft train RECIPE.yaml") -> None:
        """Adapter (or, fully fine-tuned, the model) and tokenizer at the top of the run directory:
        PeftModel.from_pretrained(run_dir) (or AutoModelForCausalLM.from_pretrained(run_dir)) loads it.
        Ctrl-C or SIGTERM while they are written saves the last step as a checkpoint instead (the resumed run
        writes them); once they go into place, the signal waits for the run to be complete."""
        if not dist.is_main():
            return
        with self.stops:
            try:
                tmp, best = self.write_final()
            except KeyboardInterrupt:
                shutil.rmtree(self.run_dir / FINAL_TMP, ignore_errors=True)
                self.save_interrupted(resume_command)
            try:
                with self.stops.atomic():
                    self.commit_final(tmp, best)
            except KeyboardInterrupt:
                self.console.print(f"\n[yellow]{self.stops.how}.[/] The run had just finished: {self.run_dir} "
                                   "is complete.")
                raise SystemExit(self.stops.exit_code) from None

    def write_final(self) -> tuple[Path, Optional[Path]]:
        """The final model (or adapter) and tokenizer in FINAL_TMP: (that folder, best/ when its files were used)."""
        tmp = self.run_dir / FINAL_TMP
        shutil.rmtree(tmp, ignore_errors=True)
        what = "model" if self.recipe.train.finetuning == "full" else "adapter"
        check_free_space(self.run_dir, adapter_bytes(self.model) + 2**24, f"{what} and tokenizer")
        if what == "model":
            self.model.config.use_cache = True  # as a loaded model expects (training turned it off)
        best = self.best_dir()
        with no_space_is_a_user_error(self.run_dir, "output.dir", AGAIN, partial=tmp):
            if best is not None:  # keep_best: the best step's files, not the last step's
                shutil.copytree(best, tmp, ignore=shutil.ignore_patterns(BEST_INFO))
            else:
                self.save_model(tmp)
            self.s.tokenizer.save_pretrained(tmp)
        follow_umask(tmp)
        return tmp, best

    def commit_final(self, tmp: Path, best: Optional[Path]) -> None:
        """Move the final files into place, plot the loss curve, mark the run completed and drop its checkpoints."""
        run_dir = self.run_dir
        for f in tmp.iterdir():
            os.replace(f, run_dir / f.name)
        tmp.rmdir()
        if self.metrics_path.is_file():
            plot_losses(self.metrics_path, run_dir / rundir.LOSS_CURVE, self.recipe.loss.type)
        if self.reporters is not None:
            self.reporters.close(run_dir / rundir.LOSS_CURVE)
        info = self.tracker.summary(self.stopped_at) if self.tracker is not None and self.tracker.best_step else {}
        if info and self.recipe.train.keep_best:
            info["best"]["written"] = best is not None  # False: best/ was lost (a shortened resume); the last is
        rundir.update_info(run_dir, step=self.step, status=rundir.COMPLETED, loss_path=self.loss.path_ran, **info)
        shutil.rmtree(rundir.checkpoints_root(run_dir), ignore_errors=True)
        shutil.rmtree(run_dir / BEST_DIR, ignore_errors=True)
        if self.initial_adapter is not None:
            shutil.rmtree(self.initial_adapter, ignore_errors=True)
        what = "model" if self.recipe.train.finetuning == "full" else "adapter"
        self.console.print(f"[bold green]done[/] {what}, tokenizer, metrics.jsonl and loss_curve.png in {run_dir}")


def run_training(recipe: Recipe, resume: Optional[bool] = None, force: bool = False,
                 console: Optional[Console] = None, resume_command: str = "delft train RECIPE.yaml") -> Path:
    """Train ``recipe`` into its output.dir: a fresh run, a resume (``resume`` None: when a checkpoint is there)
    or, with ``force``, a replaced earlier run. Returns the run directory."""
    from delft.training.lock import run_lock

    check_before_loading(recipe)  # what would otherwise be refused only once the model has loaded
    if dist.is_main():
        note_busy_machine(recipe.model.device, console or Console())
    if recipe.train.stage == "grpo":
        from delft.training.grpo import run_grpo

        if dist.world_size() > 1:
            raise UserError("train.stage grpo runs in one process here", "train.stage",
                            "Drop --nproc / torchrun for GRPO (TRL's multi-GPU GRPO goes through accelerate).")
        return run_grpo(recipe, resume, force, console, resume_command)
    dist.start(recipe.model.device)
    console = dist.rank_console(console or Console())
    check_replaceable(Path(recipe.output.dir))
    check_writable(Path(recipe.output.dir))  # the lock file goes in the run directory
    state: dict = {"opened": None, "done": False}  # the Trainer once its run directory is replaced or resumed
    try:
        with run_lock(Path(recipe.output.dir)) as lock:  # before anything in the directory is read or deleted
            try:
                trainer = _opened(recipe, resume, force, console, lock.stale_pid, resume_command, state)
                trainer.train(resume_command)
                trainer.finish(resume_command)
                state["done"] = True
            except KeyboardInterrupt:  # between the loop and the final write: the last step is saved, locked
                if state["opened"] is not None and not state["done"]:
                    with state["opened"].stops:
                        state["opened"].save_interrupted(resume_command)
                raise
    except KeyboardInterrupt:  # while the lock is taken or the model and data load (or once all is done)
        if state["done"]:
            raise
        console.print(f"\n[yellow]{signals.describe(signals.received())}.[/] Training had not begun: nothing in "
                      f"{recipe.output.dir} was changed. Resume with: {resume_command}")
        raise SystemExit(signals.exit_code(signals.received())) from None
    return trainer.run_dir


def _opened(recipe: Recipe, resume: Optional[bool], force: bool, console: Console, stale_pid: Optional[int],
            resume_command: str, state: dict) -> Trainer:
    """The Trainer, its run directory replaced or resumed (``state["opened"]`` then holds it): a signal during that
    waits for its end and then saves a checkpoint, so the directory is never left half done."""
    run_dir, ckpt, replace = prepare_run_dir(recipe, resume, force, console, stale_pid)
    trainer, kernels = _loaded(recipe, run_dir, ckpt, console)
    try:
        with signals.held():
            trainer.open_run_dir(ckpt, replace, kernels)
            state["opened"] = trainer
    except KeyboardInterrupt:
        with trainer.stops:
            trainer.save_interrupted(resume_command)
    return trainer


def _loaded(recipe: Recipe, run_dir: Path, ckpt: Optional[Path], console: Console) -> tuple[Trainer, list[str]]:
    """The run's data, model and Trainer, read before anything in the run directory changes: (trainer, kernels)."""
    random.seed(recipe.train.seed)
    s = setup(recipe)
    model, dtype, kernels = build_model(s, console)
    describe(s, model, dtype, console)
    trainer = Trainer(s, model, dtype, run_dir, console)
    if ckpt is not None:  # the total is known now, also when train.epochs sets it; nothing is changed yet
        check_steps_left(ckpt, trainer.schedule.total_steps)
    dist.barrier("setup")  # every rank has read the run directory before rank 0 replaces or resumes it
    return trainer, kernels
