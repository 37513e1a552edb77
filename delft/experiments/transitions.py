"""When each run of a study learns its task (``learns_at`` in the study file): the first step at which its held-out
exact match reaches that share, and whether it does so within training.

Trained from random weights, a small model learns arithmetic in a sharp transition whose timing depends on the
init and on small differences; a run's exact match at a fixed step then mostly says on which side of its
transition it stopped. The step of the transition measures its timing directly, and the number of seeds whose run
gets there says how reliably a recipe learns at all. Both are read from what every run already measures while it
trains: ``train.accuracy_steps``, greedy exact match on the first ``train.accuracy_examples`` problems of the eval
set, none a training problem (delft.training.heldout), in the run's metrics.jsonl.

A run that never reaches the share is censored: it counts as the last step plus one measurement interval (the
earliest it could have passed). Each endpoint compares a recipe with the reference seed by seed, as positive =
better: steps sooner (the reference's step minus the recipe's) and learned (1 for a seed whose recipe run learned
and whose reference run did not, -1 the other way, 0 where they agree: the exact sign-flip test on these is the
exact McNemar test over seeds). The sign-flip test decides both: censored steps and 0/1 outcomes are not the
normal spread the t test assumes, and the sign-flip test assumes only that the pairs are exchangeable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from delft.errors import UserError
from delft.evaluation.metrics import EXACT_MATCH
from delft.experiments.seed_tests import detectable_difference, seed_spread, sign_flip_test, t_test
from delft.rundir import METRICS, metrics_rows

STEPS_SOONER, LEARNED = "steps_sooner", "learned"  # the two endpoints' metric names in the seed-level rows


def heldout_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, held-out exact match) of every train.accuracy_steps measurement in a run's metrics.jsonl, in order
    (a resumed run's repeated steps: the last one written)."""
    points = {row["step"]: float(row[EXACT_MATCH.heldout]) for row in metrics_rows(run_dir)
              if EXACT_MATCH.heldout in row and isinstance(row.get("step"), int)}
    return sorted(points.items())


def first_pass(curve: list[tuple[int, float]], share: float) -> Optional[int]:
    """The first measured step whose exact match is at least ``share`` (None: never)."""
    return next((step for step, exact in curve if exact >= share), None)


def check_measured(cfgs: dict[str, object], where: str) -> None:
    """Every recipe must measure held-out accuracy while training, at one interval, for learns_at to read it."""
    intervals = {name: cfg.train.accuracy_steps for name, cfg in cfgs.items()}
    off = [name for name, every in intervals.items() if not every]
    if off:
        raise UserError(f"learns_at reads each run's held-out exact match while it trains, but {', '.join(off)} "
                        "measures none (train.accuracy_steps is 0)", where,
                        "Set train.accuracy_steps (e.g. 100) and train.accuracy_examples in the recipes, or drop "
                        "learns_at from the study file.")
    if len(set(intervals.values())) > 1:
        raise UserError(f"the recipes measure held-out accuracy at different intervals ({intervals}): the step at "
                        "which a run first learns would be dated more finely on one side", where,
                        "Give every recipe the same train.accuracy_steps.")


def run_transitions(runs: dict[tuple[str, int], Path], reference: str, share: float, every: int,
                    examples: int) -> dict:
    """The record study.json keeps: per recipe and seed, the measured curve and the first step at ``share``; a run
    that never gets there counts as the last step of the longest run plus one interval."""
    recipes: dict[str, dict] = {}
    for (name, seed), run in runs.items():
        curve = heldout_curve(run)
        if not curve:
            raise UserError(f"{run} has no held-out measurement in its {METRICS}", "learns_at",
                            "Train the run again with train.accuracy_steps set (delete its directory; the study "
                            "retrains what is missing).")
        recipes.setdefault(name, {})[seed] = {"steps": [s for s, _ in curve], "exact": [e for _, e in curve],
                                              "first_step": first_pass(curve, share)}
    last = max(r["steps"][-1] for per_seed in recipes.values() for r in per_seed.values())
    return {"share": share, "censored_at": last + every, "examples": examples, "every": every,
            "reference": reference, "recipes": recipes}


def _endpoint_row(where: dict, per_seed: list[float], unit: str, levels: dict) -> dict:
    """A seed-level row for one endpoint, in the shape of seed_level.comparison (no bootstrap: one number per run)."""
    t = t_test(per_seed)
    spread = seed_spread(per_seed)
    return {**where, "unit": unit, "difference": t["difference"], "t_test": t, "sign_flip": sign_flip_test(per_seed),
            "bootstrap": None, "spread": spread, "detectable": detectable_difference(spread, len(per_seed)),
            "levels": levels, "decides": "sign_flip"}


def transition_rows(record: dict, seeds: list[int]) -> list[dict]:
    """Per recipe other than the reference: steps sooner and learned, against the reference, seed by seed."""
    by_recipe = {name: {int(s): v for s, v in per_seed.items()} for name, per_seed in record["recipes"].items()}
    censored, reference = record["censored_at"], record["reference"]

    def step(name: str, seed: int) -> int:
        first = by_recipe[name][seed]["first_step"]
        return censored if first is None else first

    def learned(name: str, seed: int) -> float:
        return float(by_recipe[name][seed]["first_step"] is not None)

    where = f"held-out slice (n={record['examples']}), first step at {100 * record['share']:g} %"
    rows = []
    for name in by_recipe:
        if name == reference:
            continue
        common = {"set": where, "recipe": name, "reference": reference, "seeds": seeds, "problems": None,
                  "learned_any": any(learned(n, s) for n in (name, reference) for s in seeds)}
        sooner = [step(reference, s) - step(name, s) for s in seeds]
        rows.append(_endpoint_row({**common, "metric": STEPS_SOONER}, sooner, "steps",
                                  {"reference": _mean([step(reference, s) for s in seeds]),
                                   "recipe": _mean([step(name, s) for s in seeds])}))
        won = [learned(name, s) - learned(reference, s) for s in seeds]
        rows.append(_endpoint_row({**common, "metric": LEARNED}, won, "seeds",
                                  {"reference": _mean([learned(reference, s) for s in seeds]),
                                   "recipe": _mean([learned(name, s) for s in seeds])}))
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def transition_lines(record: Optional[dict]) -> list[str]:
    """The summary's section: per recipe and seed, the first step at the share ('never' past the last step)."""
    if not record:
        return []
    recipes = record["recipes"]
    seeds = sorted({int(s) for per_seed in recipes.values() for s in per_seed})
    lines = ["## When the runs learned", "",
             f"The first step at which each run's held-out exact match (every {record['every']} steps, on "
             f"{record['examples']} problems none of which it trained on) reached {100 * record['share']:g} %; "
             f"'never': not within training (counted as step {record['censored_at']} in the tests).", "",
             "| recipe | " + " | ".join(f"seed {s}" for s in seeds) + " | seeds that learned |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for name, per_seed in recipes.items():
        firsts = [{int(k): v for k, v in per_seed.items()}[s]["first_step"] for s in seeds]
        cells = ["never" if f is None else str(f) for f in firsts]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(f is not None for f in firsts)} / {len(seeds)} |")
    lines.append("")
    return lines
