"""The arms of a comparison trained: which recipes ``delft compare`` and ``delft study`` compare is
delft.experiments.contenders (``resolve_contenders``). Each arm is trained once per seed in
``<parent of output.dir>/<recipe name>-seed<N>`` (``run_dir_for``): a finished run there is reused and an
interrupted one resumed, both only when it was trained with this recipe (``check_adoptable``); a missing one is
trained (``ensure_trained``, ``train_all``). Differences are reported against the plain-CE arm when there is one
(``reference_name``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from delft import signals
from delft.errors import UserError
from delft.experiments.contenders import Contender
from delft.models.loading import free_memory
from delft.recipe.files import dump_recipe, load_recipe
from delft.recipe.keys import flat_keys, recipe_differences
from delft.recipe.schema import Recipe
from delft.rundir import RECIPE, has_files, is_finished_run, is_run_dir, latest_checkpoint, metrics_rows, read_info
from delft.training.launch import LAUNCH_COMMAND_ENV
from delft.training.resume import BOOKKEEPING_KEYS
from delft.training.stages import run_training

# What an existing run directory may differ in from the run compare would train there: the bookkeeping keys (the
# same adapter; delft.training.resume) and output.dir (it is this directory whatever the spelling).
ADOPT_FREE_KEYS = ("output.dir", *BOOKKEEPING_KEYS)


def check_adoptable(run_dir: Path, cfg: Recipe, what: str, where: str = "delft compare") -> None:
    """Use a run directory compare (or study) finds at a run's place only when it was trained with this recipe:
    a finished run is not reused, and an interrupted `delft train` not taken over (resumed to this recipe's steps,
    marked finished, its checkpoints deleted), when the saved recipe differs in more than ADOPT_FREE_KEYS."""
    saved_path = run_dir / RECIPE
    if not saved_path.is_file():
        return
    saved = load_recipe(saved_path)
    diff = sorted(recipe_differences(saved, cfg, ignore=ADOPT_FREE_KEYS))
    if diff:
        old, new = flat_keys(saved.to_dict()), flat_keys(cfg.to_dict())
        shown = "; ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in diff[:6])
        raise UserError(f"{run_dir} holds {what} of a different recipe ({shown}{'; ...' if len(diff) > 6 else ''})",
                        where, f"Move {run_dir} away (it is kept as it is) to train this "
                        f"recipe there, or restore the recipe it was trained with (its {RECIPE}).")


def _last_rows(run_dir: Path) -> dict:
    """The final training and validation rows of metrics.jsonl (for the JSON report)."""
    return {"validation" if "val_loss" in row else "train": row for row in metrics_rows(run_dir)}


def ensure_trained(cfg: Recipe, console: Console, command: str, nproc: Optional[int] = None) -> dict:
    """Reuse a finished run of this recipe, resume an interrupted one, or train it (``nproc``: on that many
    processes, as ``delft train --nproc`` does). Returns what happened."""
    run_dir = Path(cfg.output.dir)
    where = " ".join(command.split()[:2])  # delft compare, or delft study
    info = read_info(run_dir) if run_dir.is_dir() else {}
    if is_finished_run(run_dir):
        check_adoptable(run_dir, cfg, "a finished run", where)
        console.print(f"[dim]{run_dir}: finished run, reused[/]")
        return {"status": "reused", "steps": info.get("step"), **_last_rows(run_dir)}
    force = False
    status = "trained"
    if has_files(run_dir):
        if latest_checkpoint(run_dir) is not None:
            check_adoptable(run_dir, cfg, "an interrupted run", where)
            status = "resumed"
        elif is_run_dir(run_dir):
            check_adoptable(run_dir, cfg, "a run stopped before its first checkpoint", where)
            console.print(f"[yellow]{run_dir}: stopped before its first checkpoint; starting it again[/]")
            force = True
        else:
            raise UserError(f"{run_dir} exists and is not a delft run", where,
                            f"Move it away ({where.split()[-1]} keeps its runs beside the recipes' output.dir).")
    g = cfg.grpo
    arm = cfg.loss.type if cfg.train.stage != "grpo" else (
        f"GRPO, {g.reward} reward" + (f", aux mu {g.aux_mu:g} with {cfg.loss.type}" if g.aux_mu else ""))
    console.rule(f"[bold]{run_dir.name}[/]: training ({arm}, seed {cfg.train.seed})")
    start = time.perf_counter()
    if nproc:
        _train_launched(cfg, nproc, force, command, where)
    else:
        run_training(cfg, resume=None, force=force, console=console, resume_command=command)
    seconds = time.perf_counter() - start
    free_memory()
    steps = read_info(run_dir).get("step")
    return {"status": status, "steps": steps, "seconds": round(seconds, 1), **_last_rows(run_dir)}


def _train_launched(cfg: Recipe, nproc: int, force: bool, command: str, where: str) -> None:
    """One arm trained by ``delft train --nproc`` in a child (torchrun's ranks need a launcher of their own; this
    process stays the one that evaluates): the arm's resolved recipe goes to a temporary file, the child prints its
    own progress and errors, and a stop ends this command as it ended the child."""
    with tempfile.TemporaryDirectory(prefix="delft-arm-") as tmp:
        recipe = Path(tmp) / f"{Path(cfg.output.dir).name}.yaml"
        recipe.write_text(dump_recipe(cfg))
        argv = [sys.executable, "-m", "delft", "train", str(recipe), "--nproc", str(nproc), *(["--force"] * force)]
        # the child's resume hint names this command, which reuses the finished arms and resumes this one
        done = subprocess.run(argv, env={**os.environ, LAUNCH_COMMAND_ENV: command})
    if done.returncode in (2, 130, 143):  # a user error (the child printed its paragraph) or a stop
        raise SystemExit(done.returncode)
    if done.returncode != 0:
        raise UserError(f"training {cfg.output.dir} on {nproc} processes failed (exit {done.returncode}; its "
                        "message is above)", where, f"Fix what it says, then run {command} again: finished runs "
                        "are reused and this one resumes from its last checkpoint.")


def train_all(contenders: Sequence[Contender], seeds: Sequence[int], console: Console, command: str,
              nproc: Optional[int] = None) -> tuple[dict[tuple[str, int], Path], dict[str, dict]]:
    """Every (recipe, seed) run trained, resumed or reused, before any eval: (run directories, what happened)."""
    runs: dict[tuple[str, int], Path] = {}
    training: dict[str, dict] = {}
    for seed in seeds:
        for c in contenders:
            cfg = c.for_seed(seed)
            runs[(c.name, seed)] = Path(cfg.output.dir)
            training[f"{c.name}-seed{seed}"] = {"run": cfg.output.dir, **ensure_trained(cfg, console, command, nproc)}
            signals.check()  # a Ctrl-C lost in a finalizer after this run still stops before the next one
    return runs, training
