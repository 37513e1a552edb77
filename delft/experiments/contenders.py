"""Which recipes ``delft compare`` and ``delft study`` compare (``resolve_contenders``): they must resolve to the
same settings except their ``loss``, ``grpo`` and ``data.numbers`` sections, and a recipe another one extends is
their shared base, not an arm; each arm's run directory per seed (``run_dir_for``) and the reference the
differences are taken against (``reference_name``). Torch-free, so ``delft recipe check`` checks a study file's
recipes as the study would compare them; training the arms is delft.experiments.arms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console

from delft.errors import UserError
from delft.recipe.files import load_recipe, recipe_chain
from delft.recipe.keys import flat_keys
from delft.recipe.schema import Recipe
from delft.training import distributed as dist

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
