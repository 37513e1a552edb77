"""The arms of a comparison: which recipes ``delft compare`` and ``delft study`` compare, and their runs.

The recipes must resolve to the same settings except their ``loss`` (and ``grpo``) sections; a recipe another one
extends is their shared base, not an arm (``resolve_contenders``). Each arm is trained once per seed in
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console

from delft import signals
from delft.errors import UserError
from delft.models.loading import free_memory
from delft.recipe.files import dump_recipe, load_recipe, recipe_chain
from delft.recipe.keys import flat_keys, recipe_differences
from delft.recipe.schema import Recipe
from delft.rundir import RECIPE, has_files, is_finished_run, is_run_dir, latest_checkpoint, metrics_rows, read_info
from delft.training.resume import BOOKKEEPING_KEYS
from delft.training import distributed as dist
from delft.training.launch import LAUNCH_COMMAND_ENV
from delft.training.stages import run_training


REFERENCE_LOSS = "ce"  # differences are reported against the plain-CE run when there is one

FREE_KEYS = ("output.dir",)  # keys that may differ between compared recipes (compare sets them per run)

# What compared recipes may differ in: the loss, a GRPO stage's reward and aux, and how numbers are written in the
# trained text (data.numbers: each run is prompted and read back in its own form, so the forms compare on the same
# problems; docs/number_formats.md).
ARM_SECTIONS = ("loss.", "grpo.", "data.numbers.")


@dataclass
class Contender:
    """One compared recipe: its file, name (the file's stem) and resolved settings (before the seed)."""

    name: str
    path: Path
    recipe: Recipe

    def for_seed(self, seed: int) -> Recipe:
        cfg = self.recipe.model_copy(deep=True)
        cfg.train.seed = seed
        cfg.output.dir = str(run_dir_for(self.recipe, self.name, seed))
        return cfg


def _comparable(recipe: Recipe) -> dict[str, Any]:
    """Every resolved key except the arm sections (loss, grpo, data.numbers) and the free keys."""
    return {k: v for k, v in flat_keys(recipe.to_dict()).items()
            if not (k + ".").startswith(ARM_SECTIONS) and k not in FREE_KEYS}


def check_seeds(seeds: Sequence[int], where: str) -> list[int]:
    """The training seeds, each once ([0] when none): a repeated seed would train and count one run twice."""
    seeds = list(seeds) or [0]
    twice = [s for i, s in enumerate(seeds) if s in seeds[:i]]
    if twice:
        raise UserError(f"seed {twice[0]} is given twice ({', '.join(map(str, seeds))}): it would count one run as "
                        "two seeds", where, "Give each training seed once, e.g. 0, 1, 2.")
    return seeds


def run_dir_for(recipe: Recipe, name: str, seed: int) -> Path:
    return Path(recipe.output.dir).parent / f"{name}-seed{seed}"


# How compare and study (which shares this code) say where recipes are given, and how to give seeds.
_RECIPE_HINTS = {
    "delft compare": {"missing": "Check the path.", "seeds": "use --seed", "more": "(e.g. recipes/compare/*.yaml)"},
    "delft study": {"missing": "Check the path: a study file's recipes are relative to the study file.",
                    "seeds": "give it several seeds (seeds: [0, 1, 2])", "more": "(under recipes: in the study file)"},
}


_SHARDED_ARMS = ("Pass --nproc N: {command} then trains each arm with delft train ARM --nproc N (N processes, one per "
                 "GPU) and evaluates every run once, in this process (or set train.distributed: ddp in the arms).")


def check_one_process(command: str, where: str) -> None:
    """compare and study train, evaluate and write their results in one process: under a launcher every rank
    would train each arm, evaluate it and write the same results folder."""
    if dist.launched():
        raise UserError(f"{command} runs as one process, and this one was started by a launcher (torchrun, "
                        f"{dist.world_size()} process(es)): every rank would train each arm, evaluate it and write "
                        "the same results folder", where, f"Run {command} without torchrun. "
                        + _SHARDED_ARMS.format(command=command))


def check_unsharded(contenders: Sequence["Contender"], command: str, where: str, nproc: Optional[int]) -> None:
    """An arm with train.distributed fsdp needs several processes: compare and study start them with --nproc."""
    sharded = [c.path.name for c in contenders if c.recipe.train.distributed == "fsdp"]
    if sharded and not nproc:
        raise UserError(f"{', '.join(sharded)} shard{'s' if len(sharded) == 1 else ''} the model with "
                        f"train.distributed fsdp, which trains on several processes started together, and {command} "
                        "was given no --nproc", where, _SHARDED_ARMS.format(command=command))


def _unique_paths(paths: Sequence[Path], command: str, where: str) -> list[Path]:
    hints = _RECIPE_HINTS[command]
    if not paths:
        raise UserError("no recipes given", where, f"Give two or more recipes {hints['more']}.")
    unique: list[Path] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise UserError(f"recipe file {p} does not exist", where, hints["missing"])
        twin = next((q for q in unique if p.resolve() == q.resolve()), None)
        if twin is not None:
            raise UserError(f"{p} is given twice ({twin} is the same file)", where,
                            f"Give each recipe once; to train one recipe several times, {hints['seeds']}.")
        unique.append(p)
    return unique


def resolve_contenders(paths: Sequence[Path], overrides: Sequence[str], console: Console,
                       command: str = "delft compare", where: Optional[str] = None) -> list[Contender]:
    """Load the recipes, drop shared bases, and refuse any that differ in more than their loss. ``command``
    (delft compare or delft study) words the refusals, ``where`` (default: the command) places them."""
    where = where or command
    check_one_process(command, where)
    unique = _unique_paths(paths, command, where)
    bases = {b.resolve() for p in unique for b in recipe_chain(p)[1:]}
    contenders = []
    for p in unique:
        if p.resolve() in bases and len(unique) > 1:
            console.print(f"[dim]{p}: the shared base of the other recipes, not a run of its own[/]")
            continue
        contenders.append(Contender(p.stem, p, load_recipe(p, list(overrides))))
    if len(contenders) < 2:
        raise UserError(f"{command.split()[-1]} needs at least two recipes to compare, got {len(contenders)} "
                        f"({', '.join(str(c.path) for c in contenders)}; a recipe the others extend is their "
                        "shared base, not a run)", where, "Give two or more recipes that differ in their loss "
                        f"{_RECIPE_HINTS[command]['more']}; to train one recipe, use delft train.")
    names = [c.name for c in contenders]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"recipes share the name {', '.join(dup)} (their runs would share a directory)",
                        where, "Give each compared recipe a distinct file name.")
    first = contenders[0]
    ref = _comparable(first.recipe)
    problems = []
    for c in contenders[1:]:
        other = _comparable(c.recipe)
        for key in sorted(set(ref) | set(other)):
            if ref.get(key) != other.get(key):
                problems.append(f"{key} ({first.path.name}: {ref.get(key)!r}, {c.path.name}: {other.get(key)!r})")
    if problems:
        raise UserError("the recipes differ in more than their loss (and grpo, data.numbers) sections: "
                        + "; ".join(problems),
                        where, "Move the shared settings into one base recipe (base: base.yaml) and "
                        "let each recipe set only loss: (and output.dir).")
    for i, a in enumerate(contenders):
        for b in contenders[i + 1:]:
            if a.recipe.loss == b.recipe.loss and a.recipe.data.numbers == b.recipe.data.numbers and (
                    a.recipe.train.stage != "grpo" or a.recipe.grpo == b.recipe.grpo):
                raise UserError(f"{a.path} and {b.path} resolve to the same loss ({a.recipe.loss.type}, weight "
                                f"{a.recipe.loss.weight:g}) and number form: they would train the same run twice",
                                where, "Drop one of them.")
    return contenders


def reference_name(contenders: Sequence[Contender]) -> str:
    """The recipe differences are reported against: the plain-CE one when there is one, else the first."""
    return next((c.name for c in contenders if c.recipe.loss.type == REFERENCE_LOSS), contenders[0].name)


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
