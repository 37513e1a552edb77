"""The run lifecycle every stage of ``delft train`` goes through (delft.training.stages.STAGES): the run lock, a
new, resumed or replaced (--force) run directory (delft.training.resume), ``recipe.yaml`` and ``delft_run.json``
(written here alone, the same keys for every stage: rundir.start_info), the ``metrics.jsonl`` lines, the final
model published whole (the free space checked first, a full disk said in one paragraph), and the exit of a run
that Ctrl-C or SIGTERM stops (a checkpoint of the last whole step, exit 130 / 143, the command that resumes it).

A stage brings only what differs (``Stage``, ``StageTrainer``): its cheap checks, how it loads its model and data,
its loop, its checkpoints and its final files. Written once, the contract cannot drift between stages, and a new
stage gets all of it by going through ``run_stage``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from rich.console import Console

from delft import rundir, signals
from delft.errors import UserError
from delft.models.loading import plain_model
from delft.outputs import append_line, follow_umask, no_space_is_a_user_error, write_atomic
from delft.recipe.files import dump_recipe
from delft.recipe.schema import Recipe
from delft.training import distributed as dist
from delft.training.checkpoints import AGAIN, check_free_space, final_bytes
from delft.training.lock import run_lock
from delft.training.placement import Placement, chosen
from delft.training.report import plot_losses
from delft.training.resume import check_replaceable, check_steps_left, check_writable, prepare_run_dir, truncate_metrics
from delft.training.setup import Setup
from delft.training.signals import StopSignals

FINAL_TMP = ".final-tmp"  # the final files, written whole before they are moved to the top of the run


@dataclass
class Run:
    """One run directory while a stage trains into it: the stage's handle on what the lifecycle owns (the metrics
    lines, the run info's progress, the stop signals)."""

    dir: Path
    recipe: Recipe
    console: Console
    resume_command: str  # said when a stop leaves the run to be resumed
    stops: StopSignals
    placement: Placement  # whole weights or sharded (delft.training.placement), chosen once from the recipe
    ckpt: Optional[Path] = None  # the checkpoint the run resumes from
    replace: bool = False  # emptied (--force, or a run stopped before its first checkpoint) once the model loaded

    @property
    def metrics(self) -> Path:
        return self.dir / rundir.METRICS

    def log(self, row: dict) -> None:
        """One metrics.jsonl line, whole (rank 0 writes; a full disk is one paragraph)."""
        if dist.is_main():
            append_line(self.metrics, json.dumps(row), "output.dir", AGAIN)

    def record(self, step: int, loss_path: Optional[str], **changes) -> None:
        """The run info's step, the CE paths taken so far, and what else changed (a status, the end's summary)."""
        if dist.is_main():
            rundir.update_info(self.dir, step=step, loss_path=loss_path, **changes)


class StageTrainer(Protocol):
    """What a stage's ``load`` gives the lifecycle: its model and data loaded, a loop to run
    (delft.training.sft.Trainer, delft.training.grpo.GRPOStage)."""

    setup: Setup  # the tokenizer, data counts and base model the run info records
    model: Any
    kernels: list  # the Liger kernels applied
    total_steps: int
    step: int  # the last whole optimizer step
    loss_path: Optional[str]  # the CE paths taken (delft.losses.registry), None where delft's loss does not run
    what: str  # "adapter" or "model": the final files

    def open(self, ckpt: Optional[Path]) -> None:
        """The stage's part of opening the run directory: ``ckpt`` loaded, or left to its loop."""

    def train(self) -> None:
        """To the last step (or an early stop, or a recorded signal)."""

    def save_checkpoint(self) -> Optional[Path]:
        """A checkpoint of ``step``; None where there is none to write."""

    def write_final(self, tmp: Path) -> None:
        """The final model (or adapter) and tokenizer into ``tmp``."""

    def write_final_elsewhere(self) -> None:
        """The part of the ranks other than 0 while rank 0 writes the final files (a sharded run's gather them)."""

    def end(self) -> tuple[dict, list[Path]]:
        """Once the final files are in place: (what the run info adds, what goes with the checkpoints)."""


@dataclass(frozen=True)
class Stage:
    """One value of train.stage: its checks before the lock is taken, how it loads, and whether its loop takes a
    signal as an exception (delft's own loop) or only records it and stops at the next step's end (a loop it does
    not own, such as TRL's, which an exception mid-step would leave half done)."""

    check: Callable[[Recipe], None]
    load: Callable[[Recipe, Run], StageTrainer]
    signals_wait: bool = False


def run_stage(recipe: Recipe, stage: Stage, resume: Optional[bool], force: bool, console: Console,
              resume_command: str) -> Path:
    """Train ``recipe`` with ``stage`` into its output.dir: a fresh run, a resume (``resume`` None: when a checkpoint
    is there) or, with ``force``, a replaced earlier run. Returns the run directory."""
    run_dir = Path(recipe.output.dir)
    check_replaceable(run_dir)
    check_writable(run_dir)  # the lock file goes in the run directory
    opened: Optional[tuple[Run, StageTrainer]] = None  # once the run directory is replaced or resumed
    done = False
    try:
        with run_lock(run_dir) as lock:  # before anything in the directory is read or deleted
            opened = _opened(recipe, stage, resume, force, console, lock.stale_pid, resume_command)
            _trained(*opened)
            done = True
    except KeyboardInterrupt:  # while the lock is taken or the model and data load, or between the loop's handlers
        if done:
            raise
        if opened is None:
            console.print(f"\n[yellow]{signals.describe(signals.received())}.[/] Training had not begun: nothing in "
                          f"{run_dir} was changed. Resume with: {resume_command}")
            raise SystemExit(signals.exit_code(signals.received())) from None
        with opened[0].stops:
            _interrupted(*opened)
    return run_dir


def _opened(recipe: Recipe, stage: Stage, resume: Optional[bool], force: bool, console: Console,
            stale_pid: Optional[int], resume_command: str) -> tuple[Run, StageTrainer]:
    """The run and the stage's trainer, loaded before anything in the run directory changes, then the directory
    replaced or resumed: a signal during that waits for its end and then saves a checkpoint, so the directory is
    never left half done."""
    run_dir, ckpt, replace = prepare_run_dir(recipe, resume, force, console, stale_pid)
    placement = chosen(recipe)
    # sharded, every rank must stop at the same step to save its shards: a signal waits for the step's end
    stops = StopSignals(immediate=not (stage.signals_wait or placement.sharded))
    run = Run(run_dir, recipe, console, resume_command, stops, placement, ckpt, replace)
    trainer = stage.load(recipe, run)
    if ckpt is not None:  # the total is known now, also when train.epochs sets it; nothing is changed yet
        check_steps_left(ckpt, trainer.total_steps)
    dist.barrier("setup")  # every rank has read the run directory before rank 0 replaces or resumes it
    try:
        with signals.held():
            _open(run, trainer)
    except KeyboardInterrupt:
        with run.stops:
            _interrupted(run, trainer)
    return run, trainer


def _open(run: Run, trainer: StageTrainer) -> None:
    """Replace (--force) or resume the run directory, only now that model and data have loaded (a recipe mistake
    found while loading costs no earlier run). Rank 0 alone writes it; every rank loads the checkpoint."""
    if dist.is_main():
        if run.replace:
            run.console.print(f"[yellow]--force: replacing {run.dir}[/]")
            rundir.clear(run.dir)  # the directory stays: it holds the lock
        run.dir.mkdir(parents=True, exist_ok=True)
    trainer.open(run.ckpt)
    if not dist.is_main():
        return
    if run.ckpt is not None:
        truncate_metrics(run.metrics, trainer.step, run.console)
    write_atomic(run.dir / rundir.RECIPE, dump_recipe(run.recipe))
    r, s = run.recipe, trainer.setup
    rundir.start_info(
        run.dir, stage=r.train.stage, base_model=s.model_ref.portable_name(), base_model_path=s.model_ref.path,
        architecture=rundir.architecture(plain_model(trainer.model).config), quantization=s.quantization,
        finetuning=r.train.finetuning, init=r.model.init, continued_from=r.model.adapter, loss=r.loss.type,
        loss_weight=r.loss.weight, loss_path=trainer.loss_path, step=trainer.step, total_steps=trainer.total_steps,
        liger_kernels=trainer.kernels, data=asdict(s.stats), world_size=dist.world_size())


def _trained(run: Run, trainer: StageTrainer) -> None:
    """The stage's loop, then (rank 0) the final files. Ctrl-C or SIGTERM saves the last whole step and exits."""
    with run.stops:
        try:
            trainer.train()
        except KeyboardInterrupt:
            _interrupted(run, trainer)
        except UserError:  # a full disk, a diverged loss: the run stops where its last checkpoint is
            _mark_interrupted(run)
            raise
        if run.stops.received is not None and not run.placement.sharded:  # a stage whose signals wait:
            # its loop stopped at a step's end (a sharded loop's ranks agree there; one signalled after the last
            # step finishes the run with the others)
            _interrupted(run, trainer)
        if dist.is_main():
            _publish(run, trainer)
        else:
            trainer.write_final_elsewhere()


def _mark_interrupted(run: Run) -> None:
    """The run info says "interrupted" (resumable) after the loop stopped on a user error. On a disk still full the
    info cannot be rewritten: it stays "running", which a resume treats the same."""
    if not dist.is_main():
        return
    try:
        rundir.update_info(run.dir, status=rundir.INTERRUPTED)
    except (OSError, UserError):
        pass


def _interrupted(run: Run, trainer: StageTrainer) -> None:
    """After Ctrl-C or SIGTERM: a checkpoint of the last whole step (kept when there is one), then exit 130
    (143) with the command that resumes the run."""
    step = trainer.step
    path: Optional[Path] = rundir.checkpoint_path(run.dir, step)
    sharded = run.placement.sharded
    if not _kept(run, path, sharded):
        path = trainer.save_checkpoint()  # None on the ranks other than 0, or before a stage's first step
    run.record(step, trainer.loss_path, status=rundir.INTERRUPTED)
    if sharded:  # the ranks end together, once rank 0 has recorded the stop: a launcher sees one stopped run
        dist.barrier("the stop")
    saved = f"Saved {path}" if path is not None else "Nothing was trained yet"
    run.console.print(f"\n[yellow]{run.stops.how}.[/] {saved} (step {step}/{trainer.total_steps}). "
                      f"Resume with: {run.resume_command}")
    raise SystemExit(run.stops.exit_code)


def _kept(run: Run, path: Path, sharded: bool) -> bool:
    """Whether the checkpoint of the stopped step is there already (train.save_steps wrote it). Sharded, rank 0's
    view decides for all: every rank or none must enter the checkpoint's collectives."""
    there = path in rundir.checkpoints(run.dir)
    if sharded:
        there = bool(dist.all_reduce_floats([float(there and dist.is_main())])[0])
    return there


def _publish(run: Run, trainer: StageTrainer) -> None:
    """The final model (or adapter) and tokenizer at the top of the run directory, written whole in FINAL_TMP first.
    Ctrl-C or SIGTERM while they are written saves the last step as a checkpoint instead (the resumed run writes
    them); once they go into place, the signal waits for the run to be complete."""
    tmp = run.dir / FINAL_TMP
    try:
        _write_final(run, trainer, tmp)
        stopped = run.stops.received is not None  # a stage whose signals wait: recorded while the files were written
    except KeyboardInterrupt:
        stopped = True
    if stopped and run.placement.sharded:  # rank 0 cannot save shards alone: the run finishes
        stopped = False
    if stopped:
        shutil.rmtree(tmp, ignore_errors=True)
        _interrupted(run, trainer)
    try:
        with run.stops.atomic():
            _commit(run, trainer, tmp)
    except KeyboardInterrupt:  # raised at the commit's end; a stage whose signals wait (fsdp) only recorded it
        pass
    if run.stops.received is not None:
        run.console.print(f"\n[yellow]{run.stops.how}.[/] The run had just finished: {run.dir} is complete.")
        raise SystemExit(run.stops.exit_code)


def _write_final(run: Run, trainer: StageTrainer, tmp: Path) -> None:
    """The stage's final files in ``tmp``, the free space checked first; a disk that fills while they are written
    is one paragraph, and ``tmp`` is removed."""
    shutil.rmtree(tmp, ignore_errors=True)
    check_free_space(run.dir, final_bytes(trainer.model, trainer.setup.tokenizer), f"{trainer.what} and tokenizer")
    with no_space_is_a_user_error(run.dir, "output.dir", AGAIN, partial=tmp):
        trainer.write_final(tmp)
    follow_umask(tmp)


def _commit(run: Run, trainer: StageTrainer, tmp: Path) -> None:
    """Move the final files into place, plot the loss curve, mark the run completed and drop its checkpoints (and
    what else the stage kept only while training)."""
    for f in tmp.iterdir():
        os.replace(f, run.dir / f.name)
    tmp.rmdir()
    if run.metrics.is_file():
        plot_losses(run.metrics, run.dir / rundir.LOSS_CURVE, run.recipe.loss.type)
    info, leftovers = trainer.end()
    run.record(trainer.step, trainer.loss_path, status=rundir.COMPLETED, **info)
    for path in (rundir.checkpoints_root(run.dir), *leftovers):
        shutil.rmtree(path, ignore_errors=True)
    run.console.print(f"[bold green]done[/] {trainer.what}, tokenizer, metrics.jsonl and loss_curve.png in {run.dir}")
