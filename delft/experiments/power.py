"""A study's power before it runs: for each comparison, the smallest difference its seeds and problems can detect.

The t test over seeds (delft.experiments.seed_tests) sees each seed's difference, whose spread has two parts: how
much the loss's effect itself varies from seed to seed (tau, in points), and the sampling noise of n problems
(a per-problem variance w over n). So sd^2 = tau^2 + w / n, and the detectable difference follows from sd, the
number of seeds and the level. tau is stated in the study file (``plan.seed_spread``) or read from a pilot study's
study.json (``plan.pilot``: its seeds' differences, less the part its own problem count explains). The level is
Holm's strictest step, alpha / m over the study's m comparisons: the figure holds for the first comparison Holm
reads, and the others are no harder to see.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from delft.errors import UserError
from delft.evaluation.metrics import EXACT_MATCH
from delft.experiments.seed_level import FLOOR, scores_by_seed
from delft.experiments.seed_tests import ALPHA, POWER, detectable_difference

# The per-problem variance of a paired difference of two right/wrong answers when nothing is known about them: two
# independent answers right half the time (0.25 + 0.25). Correlated answers (the usual case: the same problems are
# hard for both) vary less, so this bound never makes a plan look better than it is.
WORST_PROBLEM_VARIANCE = 0.5


def comparisons(recipes: list[str], greedy_sets: dict[str, int], curve: bool) -> list[dict]:
    """What the study will compare: every greedy set (name -> problems) x every recipe but the first (the
    reference), for exact match and, with a curve, its area too."""
    metrics = [EXACT_MATCH.key] + (["exact_match_auc"] if curve else [])
    return [{"set": s, "recipe": r, "reference": recipes[0], "metric": m, "problems": n}
            for s, n in greedy_sets.items() for m in metrics for r in recipes[1:]]


def pilot_spreads(pilot: dict) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (set, recipe) of a pilot study.json: (tau, w), the between-seed spread of the effect beyond problem
    sampling and the per-problem variance of the paired difference, from its stored predictions. Comparisons with
    a side on the floor are left out (a set where nothing is answered shows no spread); a comparison the pilot
    lacks takes its widest."""
    out = {}
    for key, sec in pilot.get("evals", {}).items():
        if sec["settings"]["mode"] != "greedy":
            continue
        scores = {name: {s: np.array(flags) for s, flags in by_seed.items()}
                  for name, by_seed in scores_by_seed(sec).items()}
        ref = scores.get(sec["settings"]["reference"], {})
        for name, by_seed in scores.items():
            seeds = sorted(set(by_seed) & set(ref))
            if name == sec["settings"]["reference"] or len(seeds) < 2:
                continue
            if min(np.mean([by_seed[s].mean() for s in seeds]), np.mean([ref[s].mean() for s in seeds])) < FLOOR:
                continue  # a side on the floor shows no spread an effect could have: it says nothing about one
            diffs = [by_seed[s] - ref[s] for s in seeds]
            n = len(diffs[0])
            w = float(np.mean([d.var(ddof=1) for d in diffs]))
            between = float(np.var([d.mean() for d in diffs], ddof=1))
            out[(key, name)] = (max(0.0, between - w / n) ** 0.5, w)
    return out


def _spread_for(row: dict, stated: Optional[float], piloted: dict) -> tuple[float, float, str]:
    """(tau, w, where they came from) for one comparison."""
    if stated is not None:
        return stated / 100, WORST_PROBLEM_VARIANCE, "stated"
    if (row["set"], row["recipe"]) in piloted:
        return (*piloted[(row["set"], row["recipe"])], "pilot")
    tau = max(t for t, _ in piloted.values())  # the pilot's widest: a comparison it did not run is not assumed calm
    w = max(w for _, w in piloted.values())
    return tau, w, "pilot (widest)"


def plan_rows(rows: list[dict], seeds: int, margin_points: float, seed_spread: Optional[float],
              pilot: Optional[dict], family: Optional[int] = None) -> list[dict]:
    """Each comparison with its spread, the difference it can detect (80 % power, Holm's first step over
    ``family`` comparisons, default these rows) and whether that is larger than the margin."""
    piloted = pilot_spreads(pilot) if pilot is not None else {}
    if seed_spread is None and not piloted:
        raise ValueError("a plan needs a stated spread or a pilot with 2 or more seeds of a compared recipe")
    alpha = ALPHA / max(1, family or len(rows))
    out = []
    for r in rows:
        tau, w, source = _spread_for(r, seed_spread, piloted)
        sd = (tau ** 2 + w / r["problems"]) ** 0.5
        detectable = detectable_difference(sd, seeds, alpha)
        out.append({**r, "seeds": seeds, "seed_spread": tau, "problem_variance": w, "spread_source": source,
                    "sd_per_seed": sd, "alpha": alpha, "power": POWER, "detectable": detectable,
                    "above_margin": detectable is None or 100 * detectable > margin_points})
    return out


def read_pilot(path: Path, where: str) -> dict:
    """A pilot study's study.json (or its folder), as data."""
    path = path / "study.json" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"the pilot {path} is not there", where,
                        "Give an earlier study's study.json (or its out folder), or state plan.seed_spread.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"the pilot {path} is not a study.json ({e})", where,
                        "Give the study.json an earlier delft study wrote.") from None


PLAN_COLUMNS = ("set", "metric", "recipe", "seeds", "problems", "spread", "from", "detectable")


def plan_cells(r: dict, margin_points: float) -> list[str]:
    """One comparison's plan: spread between seeds and detectable difference in points, '!' past the margin."""
    detectable = "one seed" if r["detectable"] is None else f"{100 * r['detectable']:.1f}"
    flag = f" > {margin_points:g}" if r["above_margin"] else ""
    metric = "auc" if r["metric"] == "exact_match_auc" else "exact"
    return [r["set"], metric, r["recipe"], str(r["seeds"]), str(r["problems"]), f"{100 * r['seed_spread']:.1f}",
            r["spread_source"], detectable + flag]


def plan_lines(plan: Optional[dict]) -> list[str]:
    """summary.md's section on the plan a study stated before it ran."""
    if not plan or not plan.get("rows"):
        return []
    lines = ["## Power, planned before the runs", "",
             f"The smallest true difference each comparison detects with {100 * POWER:.0f} % power with the t test "
             f"over seeds at Holm's strictest step (level {plan['rows'][0]['alpha']:.3g}), from the spread between "
             "seeds (points) the plan assumed: stated in the study file or read from a pilot (the seed-level section "
             f"gives the spread the runs showed). '> {plan['margin_points']:g}': larger than the study's margin.", "",
             "| " + " | ".join(PLAN_COLUMNS) + " |", "|" + "---|" * len(PLAN_COLUMNS)]
    lines += ["| " + " | ".join(plan_cells(r, plan["margin_points"])) + " |" for r in plan["rows"]]
    lines.append("")
    if plan.get("transition_endpoints"):
        lines += [transition_plan_line(plan), ""]
    return lines


def transition_plan_line(plan: dict) -> str:
    """What the sign-flip test can show on the transition endpoints (steps sooner, learned) with the study's seeds:
    its smallest possible p against Holm's strictest level, which counts those endpoints too."""
    floor, alpha = plan["sign_flip_floor"], plan["rows"][0]["alpha"]
    seeds = plan["rows"][0]["seeds"]
    reach = ("can be significant (only when nearly every seed agrees)" if floor < alpha else
             "cannot be significant however the seeds agree: add seeds, or read them as descriptive")
    return (f"The {plan['transition_endpoints']} transition endpoints (steps sooner, learned) are decided by the "
            f"sign-flip test: with {seeds} seeds its smallest p is {floor:.3g}, against Holm's strictest level "
            f"{alpha:.3g} over all {round(ALPHA / alpha)} comparisons: the first of them {reach}.")
