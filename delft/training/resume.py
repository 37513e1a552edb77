"""The run directory before training: new, resumed (only with a recipe that differs in resume-free keys, and
never past the new recipe's steps), or replaced with --force (only a delft run directory); the metrics log cut
back to the checkpoint's step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft import rundir
from delft.errors import UserError
from delft.outputs import holds_cwd_or_home, said_removed, write_atomic
from delft.recipe.schema import Recipe
from delft.recipe.files import keep_legacy_separator, load_run_recipe, predates_separator
from delft.recipe.keys import recipe_differences
from delft.rundir import checkpoint_step, latest_checkpoint
from delft.training import distributed as dist

# Keys that change neither the adapter a run trains nor how long it trains: bookkeeping, and how the loss is
# computed (chunk size, Liger or not: the same numbers, tests/test_liger.py), so a run started on a GPU can finish
# where Liger is missing. compare and study adopt an existing run directory only when it differs in these alone.
BOOKKEEPING_KEYS = ("train.logging_steps", "train.eval_steps", "train.save_steps", "train.keep_checkpoints",
                    "train.loss_chunk_size", "train.fused_loss", "train.accuracy_steps", "train.accuracy_examples",
                    "eval")

# Keys a resumed run may change: the bookkeeping ones and the schedule length (to train longer; never shorter
# than the checkpoint's step, check_steps_left).
RESUME_FREE_KEYS = ("train.max_steps", "train.epochs", *BOOKKEEPING_KEYS)


def prepare_run_dir(recipe: Recipe, resume: Optional[bool], force: bool,
                    console: Console, stale_pid: Optional[int] = None) -> tuple[Path, Optional[Path], bool]:
    """(run dir, checkpoint to resume or None, replace the existing dir?): a fresh run or a resume.

    Never overwrites a user's run without --force, and even then only later, once the model and data have
    loaded (``Trainer.open_run_dir``): a recipe mistake found while setting up must not cost the old run.
    Called with the run directory's lock held (delft.training.lock), so no other training is using it, and after
    ``check_replaceable`` (run_training checks before the lock makes the directory and its lock file).
    """
    run_dir = Path(recipe.output.dir)
    if dist.is_main():  # the lock is held: a temporary of a process that is gone is a kill -9's leftover
        gone = rundir.remove_run_leftovers(run_dir)
        if gone:
            console.print(f"[yellow]{said_removed(gone)}[/]", highlight=False)
    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    exists = rundir.has_files(run_dir)  # the lock file alone is a fresh directory
    status = rundir.status(run_dir) if run_dir.is_dir() else None
    if exists and ckpt is None and status in (rundir.RUNNING, rundir.INTERRUPTED) and not force:
        who = f" (pid {stale_pid})" if stale_pid else ""
        console.print(f"[yellow]{run_dir} holds a run{who} that stopped before its first checkpoint: starting "
                      "over.[/]")
        return run_dir, None, True
    if force and exists:
        if run_dir.is_symlink():
            raise UserError(f"{run_dir} is a symbolic link to {run_dir.resolve()}; --force replaces only a real run "
                            "directory, never through a link", "output.dir",
                            f"Name the directory itself (output.dir: {run_dir.resolve()}) to replace it, or choose "
                            "another output.dir.")
        if not rundir.is_run_dir(run_dir):
            raise UserError(f"--force replaces only a delft run directory, and {run_dir} is not one (it has no "
                            f"{rundir.RUN_INFO})", "output.dir",
                            "Point output.dir at a new directory or an earlier run; delft never deletes other data.")
        return run_dir, None, True
    if resume is True and ckpt is None:
        raise UserError(f"--resume was given but {run_dir} holds no checkpoint", "output.dir",
                        "Drop --resume to start a new run.")
    if exists and status == rundir.COMPLETED:
        raise UserError(f"{run_dir} already holds a finished run", "output.dir",
                        "Choose another output.dir (e.g. --set output.dir=runs/new) or pass --force to replace it.")
    if ckpt is not None and resume is not False:
        saved = load_run_recipe(run_dir)
        if predates_separator(run_dir):  # the run goes on with the prompts it started with
            keep_legacy_separator(recipe)
        diff = resume_differences(run_dir, saved, recipe, console)
        if diff:
            raise UserError(f"{run_dir} holds a checkpoint of a run with a different recipe ({', '.join(diff)} "
                            "differ)", "output.dir",
                            "Use another output.dir, restore the recipe, or pass --force to start over.")
        if recipe.train.max_steps is not None:  # before any model loads; an epochs-derived total: run_training
            check_steps_left(ckpt, recipe.train.max_steps)
        console.print(f"[bold cyan]Resuming[/] from {ckpt} (pass --no-resume --force to start over).")
        return run_dir, ckpt, False
    if exists:
        what = "an interrupted run" if ckpt else "files"
        raise UserError(f"{run_dir} already exists and holds {what}", "output.dir",
                        "Choose another output.dir or pass --force to replace it.")
    return run_dir, None, False


def resume_differences(run_dir: Path, saved: Recipe, recipe: Recipe, console: Console) -> list[str]:
    """The keys in which ``recipe`` may not differ from the recipe saved in ``run_dir`` and does. That recipe is
    the one inside run_dir: another output.dir in it only says the directory was moved or renamed since (or is
    named by another path), and it is this directory that is resumed."""
    diff = recipe_differences(saved, recipe, (*RESUME_FREE_KEYS, "output.dir"))
    diff = check_resume(rundir.read_info(run_dir), saved, recipe, diff, console)
    if saved.output.dir != recipe.output.dir and Path(saved.output.dir).absolute() != run_dir.absolute():
        console.print(f"{run_dir} was trained as {saved.output.dir}: resuming it where it is now.", highlight=False)
    return diff


def other_layout(was: str, now: str, checkpoint: Optional[Path] = None) -> UserError:
    """The one refusal of a resume across train.distributed: found from the two recipes (``check_resume``), or from
    a checkpoint whose files are the other layout's (``checkpoint``; the trainer's loaders, as they read it)."""
    held = "shards" if was == "fsdp" else "whole weights"
    what = (f"{checkpoint} holds the {held} of a train.distributed {was} run, which this recipe's {now} cannot "
            "resume" if checkpoint is not None else
            f"the run was trained with train.distributed {was} and this recipe says {now}; its checkpoints hold "
            f"{held}, which the other way cannot resume")
    launcher = " under a launcher (--nproc N)" if was == "fsdp" else ""
    return UserError(what, "train.distributed", f"Resume it with train.distributed: {was} (its recipe.yaml){launcher}, "
                     "or start a new run from its final model or adapter once it has finished.")


def check_resume(saved_info: dict, saved_recipe, recipe, diff: list[str], console) -> list[str]:
    """The recipe differences left after allowing a new world size with the same global batch.

    The global batch is ``batch_size x grad_accum x world_size``; a resume may trade grad_accum for processes
    as long as that product and batch_size stay. Then the step sequence and the examples are the same, but
    not which rank runs which micro-batch, so dropout masks differ from an uninterrupted run (said).
    """
    if "train.distributed" in diff:
        raise other_layout(saved_recipe.train.distributed, recipe.train.distributed)
    was, now = int(saved_info.get("world_size", 1)), dist.world_size()
    if was == now:
        return diff
    st, t = saved_recipe.train, recipe.train
    rest = [d for d in diff if d != "train.grad_accum"]
    if st.batch_size == t.batch_size and st.grad_accum * was == t.grad_accum * now:
        console.print(f"[yellow]Resuming with {now} process(es) instead of {was}[/]: the same global batch "
                      f"({t.batch_size} x {t.grad_accum} x {now}) and the same examples per step; dropout masks "
                      "differ from an uninterrupted run.")
        return rest
    need = st.grad_accum * was / now
    fix = (f"Run it with {was} process(es) again" + (f", or with {now} and --set train.grad_accum={int(need)}"
                                                      if need == int(need) and need >= 1 else "") + ".")
    raise UserError(f"the run was trained with {was} process(es) and a global batch of {st.batch_size} x "
                    f"{st.grad_accum} x {was}; {now} process(es) with train.grad_accum={t.grad_accum} would change "
                    "it", "output.dir", fix)


def check_steps_left(ckpt: Path, total_steps: int) -> None:
    """A resume never marks a run finished past its steps: a checkpoint beyond the new total is refused (it
    would otherwise "complete" at once, untrained to its own recipe's length, and lose its checkpoints)."""
    step = checkpoint_step(ckpt)
    if step > total_steps:
        raise UserError(f"{ckpt} is at step {step}, but this recipe trains {total_steps} steps (train.max_steps, or "
                        "train.epochs when max_steps is unset): resuming would mark the run finished without "
                        "training and delete its checkpoints", "train.max_steps",
                        f"Resume with train.max_steps of {step} or more (e.g. --set train.max_steps={step}), "
                        "or pass --force to start the run over.")


def check_replaceable(run_dir: Path) -> None:
    """Refuse an output.dir that is no place for a run: the current directory, one above it, home, a file, a
    symbolic link to nothing (a dangling one or a loop: delft would make neither the link nor its target)."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise UserError(f"{run_dir} is a symbolic link to {os.readlink(run_dir)}, which does not exist (or loops)",
                        "output.dir", "Remove the link, make the directory it points to, or choose another "
                        "output.dir.")
    where = run_dir.expanduser().resolve()
    if str(run_dir).strip() in ("", ".") or holds_cwd_or_home(run_dir):
        raise UserError(f"output.dir {str(run_dir)!r} is {where}, which holds the current directory or your home",
                        "output.dir", "Name a directory of its own for the run, e.g. output.dir: runs/my-run.")
    if where.exists() and not where.is_dir():
        raise UserError(f"{run_dir} exists and is not a directory", "output.dir",
                        "Choose another output.dir; delft does not replace files.")


def check_writable(run_dir: Path) -> None:
    """Before any weights load: a run directory delft could not write to is refused now, not after setup."""
    place = run_dir if run_dir.exists() else next(p for p in run_dir.absolute().parents if p.exists())
    if not place.is_dir():
        raise UserError(f"{place} is a file, so {run_dir} cannot be made inside it", "output.dir",
                        "Choose an output.dir whose parent is a directory.")
    if not os.access(place, os.W_OK | os.X_OK):
        raise UserError(f"{place} is not writable, so the run cannot be saved in {run_dir}", "output.dir",
                        "Choose an output.dir in a directory you can write to.")


def truncate_metrics(path: Path, step: int, console: Console) -> None:
    """On resume, forget log lines written after the checkpoint (they will be written again); a last line
    half-written by a killed run is dropped, and said so."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, ln in enumerate(lines):
        try:
            rows.append((ln, json.loads(ln)))
        except ValueError:
            if i < len(lines) - 1:
                raise UserError(f"{path} line {i + 1} is not JSON", "output.dir",
                                "Fix or delete that line (it is a log; the checkpoint holds the state).") from None
            console.print(f"[yellow]{path.name}: dropped a half-written last line (the run was stopped while "
                          "writing it)[/]")
    keep = [ln for ln, row in rows if isinstance(row, dict) and row.get("step", 0) <= step]
    write_atomic(path, "".join(ln + "\n" for ln in keep))
