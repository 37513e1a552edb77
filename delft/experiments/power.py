"""A study's power before it runs: for each comparison, the smallest difference its seeds and problems can detect.

The t test over seeds (delft.experiments.seed_tests) sees each seed's difference, whose spread has two parts: how
much the loss's effect itself varies from seed to seed (tau, in points), and the sampling noise of n problems
(a per-problem variance w over n). So sd^2 = tau^2 + w / n, and the detectable difference follows from sd, the
number of seeds and the level. tau is stated in the study file (``plan.seed_spread``) or read from a pilot study's
study.json (``plan.pilot``: the upper end of the 95 % interval of its seeds' spread, less the part its own problem
count explains: 3 seeds' spread has an upper bound 6.3 times itself, and a plan should not promise what a pilot
only happened to show). A pilot must have run every arm it plans for: lending one arm's spread to another (a
control's to a digit loss whose spread is ten times larger) is refused; with both stated, the stated spread covers
the arms the pilot did not run and the larger of the two the ones it did.

Where the study decides on the two-way interval (every seed scored on the same problems), the mean's variance is
tau^2 / seeds + b / problems + e / (seeds x problems), with b and e the problem and residual variance components
of the paired differences (a pilot's two-way ANOVA, or at worst, stated, all of w taken as b), and the detectable
difference is (t_{1 - alpha/2} + t_{power}) x that standard error at Satterthwaite's degrees of freedom.

The level is Holm's strictest step, alpha / m over the study's family of m comparisons: the figure holds for the
first comparison Holm reads, and the others are no harder to see. The plan states the smallest p each endpoint can
reach (an exact test's 2 / 2^k over the k seeds that can differ; the learned endpoint only on the seeds the
reference does not learn on) and keeps the endpoints that cannot reach the level out of the family, listed as
descriptive. A calibrator is tested alone at the level, outside the family. A positive control (or calibrator)
that did not move in its pilot is flagged before the study runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from scipy import stats

from delft.errors import UserError
from delft.evaluation.metrics import EXACT_MATCH
from delft.experiments.seed_level import FLOOR, deciding_p, scores_by_seed
from delft.experiments.seed_tests import ALPHA, POWER, detectable_difference, spread_upper_bound, two_way_test

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
    sampling and the per-problem variance of the paired difference, from its stored predictions (the estimates;
    ``pilot_detail`` adds their upper bound and the two-way components)."""
    return {key: (d["tau"], d["w"]) for key, d in pilot_detail(pilot).items()}


def pilot_detail(pilot: dict) -> dict[tuple[str, str], dict]:
    """Per (set, recipe) of a pilot study.json: tau (the between-seed spread of the effect beyond problem sampling),
    tau_upper (the same from the upper end of the 95 % interval of the seeds' spread), w (the per-problem variance
    of the paired difference), the two-way components (problem, residual) and the pilot's seeds and problems.
    Comparisons with a side on the floor are left out (a set where nothing is answered shows no spread)."""
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
            upper = spread_upper_bound(between ** 0.5, len(seeds)) ** 2
            parts = two_way_test([ref[s] for s in seeds], [by_seed[s] for s in seeds])["components"] or {}
            out[(key, name)] = {"tau": max(0.0, between - w / n) ** 0.5, "tau_upper": max(0.0, upper - w / n) ** 0.5,
                                "w": w, "problem": parts.get("problem", w), "residual": parts.get("residual", 0.0),
                                "seeds": len(seeds), "problems": n}
    return out


def floored_in_pilot(pilot: Optional[dict], planned: list[dict]) -> list[tuple[str, str]]:
    """The (set, recipe) comparisons the pilot ran with 2 or more seeds beside the reference but shows no spread
    for, because a side sat on the floor there (pilot_detail leaves those out): a plan leaves them out and says so,
    as a study reads a difference on a floor as not readable."""
    if pilot is None:
        return []
    piloted = pilot_detail(pilot)
    out = []
    for r in planned:
        sec = pilot.get("evals", {}).get(r["set"])
        if (r["set"], r["recipe"]) in piloted or not sec or sec["settings"].get("mode") != "greedy":
            continue
        scores = scores_by_seed(sec)
        shared = set(scores.get(r["recipe"], {})) & set(scores.get(sec["settings"].get("reference"), {}))
        if len(shared) >= 2 and (r["set"], r["recipe"]) not in out:
            out.append((r["set"], r["recipe"]))
    return out


class Unpiloted(ValueError):
    """The pilot did not run these (set, recipe) comparisons, and no spread is stated for them."""


def _spread_for(row: dict, stated: Optional[float], w_stated: Optional[float], piloted: dict) -> dict:
    """The spread one comparison is planned with: tau, w, the two-way components and where they came from."""
    key = (row["set"], row["recipe"])
    w = WORST_PROBLEM_VARIANCE if w_stated is None else w_stated
    mine = {"tau": None if stated is None else stated / 100, "w": w, "problem": w, "residual": 0.0,
            "source": "stated"}
    if key not in piloted:
        if stated is None:
            raise Unpiloted(key)
        return mine
    p = piloted[key]
    ours = {"tau": p["tau_upper"], "w": p["w"], "problem": p["problem"], "residual": p["residual"],
            "source": "pilot bound"}
    if stated is not None and mine["tau"] > ours["tau"]:
        return {**ours, "tau": mine["tau"], "source": "stated (above the pilot's bound)"}
    return ours


def two_way_detectable(tau: float, problem: float, residual: float, seeds: int, problems: int, alpha: float,
                       power: float = POWER) -> tuple[Optional[float], float, Optional[float]]:
    """(detectable difference, its standard error, Satterthwaite df) of the two-way interval over ``seeds`` and
    ``problems`` with these variance components: the mean squares they imply, combined as the test combines
    them."""
    if seeds < 2 or problems < 2:
        return None, float("nan"), None
    var = tau ** 2 / seeds + problem / problems + residual / (seeds * problems)
    ms = (residual + problems * tau ** 2, residual + seeds * problem, residual)
    coef = (1.0, 1.0, -1.0)
    dfs = (seeds - 1, problems - 1, (seeds - 1) * (problems - 1))
    parts = [c * m for c, m in zip(coef, ms)]
    df = sum(parts) ** 2 / sum(x * x / f for x, f in zip(parts, dfs) if x) if var > 0 else None
    if df is None:
        return None, 0.0, None
    se = var ** 0.5
    return float((stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)) * se), se, float(df)


def plan_rows(rows: list[dict], seeds: int, margin_points: float, seed_spread: Optional[float],
              pilot: Optional[dict], family: Optional[int] = None, decide: str = "t",
              problem_variance: Optional[float] = None, calibrators: Sequence[str] = ()) -> list[dict]:
    """Each comparison with its spread, the difference it can detect (80 % power, Holm's first step over
    ``family`` comparisons, default these rows less the calibrators', which are tested alone at ALPHA) and whether
    that is larger than the margin. Raises Unpiloted, naming the comparisons, when the pilot lacks some and no
    spread is stated."""
    piloted = pilot_detail(pilot) if pilot is not None else {}
    if seed_spread is None and not piloted:
        raise ValueError("a plan needs a stated spread or a pilot with 2 or more seeds of a compared recipe")
    missing = [(r["set"], r["recipe"]) for r in rows if seed_spread is None and (r["set"], r["recipe"]) not in piloted]
    if missing:
        raise Unpiloted(missing)
    in_family = [r for r in rows if r["recipe"] not in calibrators]
    strictest = ALPHA / max(1, family or len(in_family))
    out = []
    for r in rows:
        sp = _spread_for(r, seed_spread, problem_variance, piloted)
        alpha = ALPHA if r["recipe"] in calibrators else strictest
        sd = (sp["tau"] ** 2 + sp["w"] / r["problems"]) ** 0.5
        if decide == "two_way":
            detectable, se, df = two_way_detectable(sp["tau"], sp["problem"], sp["residual"], seeds, r["problems"],
                                                    alpha)
        else:
            detectable, se, df = detectable_difference(sd, seeds, alpha), sd / seeds ** 0.5, seeds - 1
        out.append({**r, "seeds": seeds, "seed_spread": sp["tau"], "problem_variance": sp["w"],
                    "problem_component": sp["problem"], "residual_component": sp["residual"],
                    "spread_source": sp["source"], "sd_per_seed": sd, "se": se, "df": df, "decide": decide,
                    "alpha": alpha, "power": POWER, "detectable": detectable,
                    "role": "calibrator" if r["recipe"] in calibrators else None,
                    "smallest_p": 2 / 2 ** seeds if decide in ("sign_flip", "wilcoxon") else 0.0,
                    "above_margin": detectable is None or 100 * detectable > margin_points})
    return out


def endpoint_floors(names: Sequence[str], seeds: int, pilot: Optional[dict]) -> list[dict]:
    """The transition endpoints (steps sooner, learned) of every arm with the smallest p the sign-flip test can
    give them: 2 / 2^seeds for steps sooner; for learned only the seeds where the reference does not learn can
    favour the arm, so 2 / 2^(seeds - those it learns on), the reference's share read from the pilot's
    transitions (none known: every seed). An endpoint whose smallest p is not below ALPHA is descriptive."""
    share = _reference_learned_share(pilot)
    expected = 0 if share is None else round(share * seeds)
    out = []
    for name in names[1:]:
        for metric, free in (("steps_sooner", seeds), ("learned", seeds - expected)):
            floor = 1.0 if free < 1 else min(1.0, 2 / 2 ** free)
            out.append({"recipe": name, "metric": metric, "smallest_p": floor, "descriptive": floor >= ALPHA,
                        "why": None if metric == "steps_sooner" else (
                            f"the reference learned on {expected} of {seeds} seeds (its pilot share"
                            f" {share:.2f}), so at most {free} can favour the arm" if share is not None else
                            "no pilot shows how often the reference learns: every seed counted")})
    return out


def _reference_learned_share(pilot: Optional[dict]) -> Optional[float]:
    record = (pilot or {}).get("transitions")
    if not record:
        return None
    ref = record["recipes"].get(record["reference"], {})
    return sum(v["first_step"] is not None for v in ref.values()) / len(ref) if ref else None


def control_flags(pilot: Optional[dict], controls: Sequence[str], calibrators: Sequence[str]) -> list[dict]:
    """Each positive control (expected up) and calibrator (expected down) that did not move that way in the pilot,
    on any of its rows there: a design whose control already failed is flagged before the study runs, not after.
    A control's move is read from its Holm p in the pilot, a calibrator's from its own p (it is tested alone)."""
    rows = (pilot or {}).get("seed_level") or []
    flags = []
    for name, want in [(c, 1) for c in controls] + [(c, -1) for c in calibrators]:
        own = [r for r in rows if r["recipe"] == name]
        role = "control" if want > 0 else "calibrator"
        if not own:
            flags.append({"recipe": name, "role": role, "why": "no pilot row shows that it moves" if pilot else
                          "no pilot: nothing shows that it moves"})
            continue

        def moved(r: dict) -> bool:
            p = deciding_p(r) if want < 0 else r.get("holm_p")
            return p is not None and p < ALPHA and r["difference"] * want > 0

        if not any(moved(r) for r in own):
            best = min(own, key=lambda r: -r["difference"] * want)
            p = deciding_p(best) if want < 0 else best.get("holm_p")
            flags.append({"recipe": name, "role": role,
                          "why": f"it did not move {'up' if want > 0 else 'down'} in its pilot ({best['set']}, "
                                 f"{best['metric']}: {best['difference']:+.3g}, p "
                                 f"{'-' if p is None else f'{p:.3g}'})"})
    return flags


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


PLAN_COLUMNS = ("set", "metric", "recipe", "seeds", "n", "spread", "from", "level", "detectable")
DECIDE_NAMES = {"t": "the t test over seeds", "two_way": "the two-way interval over seeds and problems",
                "sign_flip": "the sign-flip test over seeds (power from the t test's)",
                "wilcoxon": "the Wilcoxon test over seeds (power from the t test's)"}


def plan_cells(r: dict, margin_points: float) -> list[str]:
    """One comparison's plan: spread between seeds and detectable difference in points, '!' past the margin."""
    detectable = "one seed" if r["detectable"] is None else f"{100 * r['detectable']:.1f}"
    flag = f" > {margin_points:g}" if r["above_margin"] else ""
    metric = "auc" if r["metric"] == "exact_match_auc" else "exact"
    level = f"{r['alpha']:.3g}" + (" (alone)" if r.get("role") == "calibrator" else "")
    return [r["set"], metric, r["recipe"], str(r["seeds"]), str(r["problems"]), f"{100 * r['seed_spread']:.1f}",
            r["spread_source"], level, detectable + flag]


def endpoint_lines(plan: dict) -> list[str]:
    """The plan's endpoints whose test has a smallest p, and which of them are descriptive (outside the family)."""
    out = []
    for e in plan.get("endpoints") or []:
        role = "descriptive: it cannot reach the level, so it is outside Holm's family" if e["descriptive"] else \
            "in Holm's family"
        why = f" ({e['why']})" if e.get("why") else ""
        out.append(f"- {e['recipe']}, {e['metric']}: smallest possible p {e['smallest_p']:.3g}{why}: {role}.")
    return out


def flag_lines(plan: dict) -> list[str]:
    """The controls and calibrators that did not move in the pilot, flagged before the runs."""
    return [f"- Flagged: the {f['role']} {f['recipe']}: {f['why']}. If it does not move in this study either, the "
            "design cannot see the effect it is there to show." for f in plan.get("flags") or []]


def plan_lines(plan: Optional[dict]) -> list[str]:
    """summary.md's section on the plan a study stated before it ran."""
    if not plan or not plan.get("rows"):
        return []
    test = DECIDE_NAMES[plan.get("decide", "t")]
    lines = ["## Power, planned before the runs", "",
             f"The smallest true difference each comparison detects with {100 * POWER:.0f} % power with {test} at "
             f"Holm's strictest step (a calibrator: alone, at {ALPHA:g}), from the spread between seeds (points) the "
             "plan assumed: stated in the study file or the upper end of a pilot's 95 % interval (the seed-level "
             f"section gives the spread the runs showed). '> {plan['margin_points']:g}': larger than the study's "
             "margin.", "", "| " + " | ".join(PLAN_COLUMNS) + " |", "|" + "---|" * len(PLAN_COLUMNS)]
    lines += ["| " + " | ".join(plan_cells({"alpha": plan["rows"][0]["alpha"], **r}, plan["margin_points"])) + " |"
              for r in plan["rows"]]
    lines.append("")
    if plan.get("endpoints") is not None:
        lines += [*endpoint_lines(plan), *flag_lines(plan), ""] if plan.get("endpoints") or plan.get("flags") else []
    elif plan.get("transition_endpoints"):  # a study.json written before the plan listed each endpoint
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
