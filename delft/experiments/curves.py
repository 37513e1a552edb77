"""Learning curves in a study (``curve: [steps]``): every run keeps a snapshot of its model at those steps
(train.snapshot_steps), the study evaluates each snapshot on every greedy set as it evaluates the final runs, and
reports exact match at each step and the area under that curve.

The curve starts at step 0 with the base model (the pretrained start, or the untrained init of a scratch study)
and ends with the finished run. The area is the trapezoid rule over the steps divided by the last step: the mean
exact match over training, in [0, 1]; a loss that learns faster has a larger area even when the arms end level.
Each problem's own area (its 0/1 exact flags through the trapezoid) is what the seed-level analysis resamples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from delft.errors import UserError
from delft.evaluation.metrics import EXACT_MATCH
from delft.rundir import snapshot_path


def snapshot_override(curve: Sequence[int]) -> str:
    """The --set that makes every run of the study keep its curve's snapshots."""
    return f"train.snapshot_steps=[{', '.join(str(s) for s in curve)}]"


def check_curve(curve: Sequence[int], total_steps: int, where: str) -> None:
    """Every curve step must come before the end of training (the end itself is the finished run)."""
    late = [s for s in curve if s >= total_steps]
    if late:
        raise UserError(f"curve steps {late} are not before the end of training (step {total_steps})", where,
                        f"Give steps below {total_steps}; the finished run is the curve's last point.")


def runs_at(runs: dict[tuple[str, int], Path], step: int) -> dict[tuple[str, int], Path]:
    """Every run's snapshot at ``step``; a missing one (the run was trained without the curve) is refused."""
    found = {key: snapshot_path(run, step) for key, run in runs.items()}
    missing = [str(p) for p in found.values() if not p.is_dir()]
    if missing:
        raise UserError(f"{len(missing)} runs have no snapshot at step {step} (e.g. {missing[0]})", "curve",
                        "Train them again with the curve (delft study --force retrains nothing: delete those run "
                        "directories, or set train.snapshot_steps in the recipes before training).")
    return found


def exact_flags(section: dict) -> dict:
    """Per model of a greedy section: its per-problem exact flags, by (recipe, seed); the base under (None, None)."""
    return {(m["recipe"], m["seed"]): [float(p["exact"]) for p in m["predictions"]] for m in section["models"]}


def trapezoid(steps: Sequence[int], values: Sequence[float]) -> float:
    """The area under (steps, values) by the trapezoid rule, divided by the span of the steps."""
    area = sum((b - a) * (u + v) / 2 for a, b, u, v in zip(steps, steps[1:], values, values[1:]))
    return area / (steps[-1] - steps[0])


def curve_of(points: dict[int, dict], final: dict, total_steps: int) -> dict:
    """One set's curve: its steps (0, the snapshots, the end) and, per recipe and seed, exact match at each step,
    the area, and each problem's area."""
    steps = [0, *sorted(points), total_steps]
    flags = [exact_flags(points[s]) for s in sorted(points)] + [exact_flags(final)]
    base = flags[-1][(None, None)]
    recipes: dict[str, dict] = {}
    for recipe, seed in flags[-1]:
        if recipe is None:
            continue
        per_step = [base] + [f[(recipe, seed)] for f in flags]
        per_problem = [trapezoid(steps, [row[i] for row in per_step]) for i in range(len(base))]
        arm = recipes.setdefault(recipe, {EXACT_MATCH.key: {}, "auc": {}, "auc_per_problem": {}})
        arm[EXACT_MATCH.key][seed] = [sum(row) / len(row) for row in per_step]
        arm["auc"][seed] = sum(per_problem) / len(per_problem)
        arm["auc_per_problem"][seed] = per_problem
    for arm in recipes.values():
        seeds = list(arm["auc"])
        arm["mean_exact_match"] = [sum(arm[EXACT_MATCH.key][s][i] for s in seeds) / len(seeds)
                                   for i in range(len(steps))]
        arm["mean_auc"] = sum(arm["auc"].values()) / len(seeds)
    return {"steps": steps, "reference": final["settings"]["reference"], "base_exact_match": sum(base) / len(base),
            "recipes": recipes}


def study_curves(curve: Sequence[int], greedy_sets: Sequence[str], sections: dict, runs: dict, total_steps: int,
                 evaluate: Callable[[str, int, dict], dict]) -> dict:
    """Every greedy set evaluated at every curve step (``evaluate(key, step, runs_at_step)`` returns the set's
    section): the curves by set, exact match per step and each problem's area (the predictions stay in the final
    sections)."""
    out = {}
    for key in greedy_sets:
        points = {step: evaluate(key, step, runs_at(runs, step)) for step in curve}
        out[key] = curve_of(points, sections[key], total_steps)
    return out


def curve_lines(curves: dict) -> list[str]:
    """The summary's learning-curve section: seed-mean exact match at each step and the area per recipe."""
    if not curves:
        return []
    lines = ["## Learning curves", "",
             "Exact match (mean over seeds) at each training step (step 0: the base model); area: the mean exact "
             "match over training (trapezoid rule), per seed in brackets.", ""]
    for key, c in curves.items():
        lines += [f"### {key}", "", "| recipe | " + " | ".join(f"step {s}" for s in c["steps"]) + " | area |",
                  "|---|" + "---|" * (len(c["steps"]) + 1)]
        for name, arm in c["recipes"].items():
            per_seed = ", ".join(f"{100 * v:.1f}" for v in arm["auc"].values())
            lines.append(f"| {name} | " + " | ".join(f"{100 * v:.1f}" for v in arm["mean_exact_match"])
                         + f" | {100 * arm['mean_auc']:.1f} ({per_seed}) |")
        lines.append("")
    return lines
