"""Metrics over scored answers: the metric table every reader shows them from, percentile and paired bootstrap
intervals, one model's summary (exact and tolerance match, errors, per-place digit accuracy) and paired differences
(the tests with the seed as the unit are delft.experiments.seed_tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from delft.evaluation.problems import BOOTSTRAP_SEED
from delft.numbers.answers import RULES, Scored, signed_log
from delft.numbers.digits import place_name


@dataclass(frozen=True)
class Metric:
    """One metric of a model's answers and how every reader shows it: delft eval's table and JSON, compare's and
    study's tables and differences, the model card, the held-out accuracy while training. A new metric is its
    value (a Scored field or a model's summary), its line in :func:`summarize`, and a row in METRICS."""

    key: str  # its name in a model's metrics (eval.json, compare.json, study.json)
    label: str  # its row in delft eval's table; {k}: the number of samples
    name: str  # what Markdown columns, headlines and difference lines call it
    short: str = ""  # compare's difference lines, where the paired rows share one line
    rate: bool = True  # a share in [0, 1], shown as a percentage; else a number in ``fmt``
    fmt: Optional[str] = None  # a number's format spec (delft.outputs.num; None: four significant figures)
    higher_is_better: bool = True  # which end of a table row is set in bold
    interval: bool = False  # summarised with a percentile bootstrap interval over problems, under key + "_ci"
    per_problem: Optional[str] = None  # the Scored field whose paired differences (vs base, reference) are kept
    block: Optional[str] = None  # the part of a model's metrics that holds it (SAMPLING: sampled runs only)
    only: Optional[str] = None  # delft eval shows it only "sampled", with "harness", or where some model has it ("set")
    voted: bool = False  # when sampled it scores the majority vote, and its label says so
    column: Optional[int] = None  # its place among the columns of compare's and study's Markdown tables
    headline: bool = False  # one of the few numbers the model card and compare's per-seed lists keep
    heldout: Optional[str] = None  # its name in metrics.jsonl, measured while training (delft.training.heldout)


SAMPLING = "sampling"  # a sampled run's block of metrics (delft.evaluation.sampling.summarize_samples)


EXACT_MATCH = Metric("exact_match", "exact match (95 % CI)", "exact match", "exact", interval=True,
                     per_problem="exact", voted=True, column=0, headline=True, heldout="accuracy")
PASS_1 = Metric("pass@1", "pass@1: mean over samples (95 % CI)", "pass@1", interval=True, block=SAMPLING,
                only="sampled")
PASS_K = Metric("pass@k", "pass@{k} (95 % CI)", "pass@k", interval=True, block=SAMPLING, only="sampled")
STRICT_MATCH = Metric("strict_match", "strict-match (harness, 95 % CI)", "strict-match", interval=True,
                      only="harness", voted=True)
FLEXIBLE_EXTRACT = Metric("flexible_extract", "flexible-extract (harness, 95 % CI)", "flexible-extract",
                          interval=True, only="harness", voted=True)
TASK_SCORE = Metric("task_score", "task's own score (reasoning-gym)", "task's own score", rate=False, fmt=".3f",
                    only="set")
TOLERANCE_MATCH = Metric("tolerance_match", "tolerance match (95 % CI)", "tolerance match", "tolerance",
                         interval=True, per_problem="tolerance", column=1, headline=True,
                         heldout="tolerance_accuracy")
NO_NUMBER = Metric("no_number_rate", "no number", "no number", higher_is_better=False, column=5, headline=True)
MAE = Metric("mae", "MAE", "MAE", rate=False, higher_is_better=False, column=3, headline=True)
LOG_MAE = Metric("log_mae", "log-MAE", "log-MAE", rate=False, higher_is_better=False, column=4)
DIGIT_ACCURACY = Metric("digit_accuracy", "digit accuracy (all places)", "digit accuracy", column=2, headline=True,
                        heldout="digit_accuracy")

# In delft eval's order; the per-place digit accuracy rows follow them there.
METRICS = (EXACT_MATCH, PASS_1, PASS_K, STRICT_MATCH, FLEXIBLE_EXTRACT, TASK_SCORE, TOLERANCE_MATCH, NO_NUMBER, MAE,
           LOG_MAE, DIGIT_ACCURACY)
PAIRED = tuple(m for m in METRICS if m.per_problem)  # the per-problem rows every comparison differences
COLUMNS = tuple(sorted((m for m in METRICS if m.column is not None), key=lambda m: m.column))
HEADLINE = tuple(m for m in COLUMNS if m.headline)


def metric_value(metrics: dict, m: Metric):
    """``m``'s value in one model's metrics (None where that model has none)."""
    return (metrics.get(m.block) or {} if m.block else metrics).get(m.key)


def bootstrap_ci(flags: Sequence[bool | float], resamples: int = 1000, seed: int = 0,
                 level: float = 0.95) -> Optional[tuple[float, float]]:
    """Percentile bootstrap interval of the mean of ``flags``; None when empty or resamples == 0.

    The resample indices depend only on (len(flags), resamples, seed), so two models scored on the same set
    get the same resamples (a paired comparison)."""
    import numpy as np

    n = len(flags)
    if n == 0 or resamples <= 0:
        return None
    values = np.asarray(flags, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // n)  # bounded memory: at most ~2M indices at once
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = values[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def paired_difference(a: Sequence[bool], b: Sequence[bool], resamples: int = 1000, seed: int = 0,
                      level: float = 0.95) -> dict:
    """mean(b) - mean(a) and its paired bootstrap interval (same problems resampled for both)."""
    if len(a) != len(b):
        raise ValueError("paired_difference needs the same problems for both models")
    diff = [float(y) - float(x) for x, y in zip(a, b)]
    ci = bootstrap_ci(diff, resamples, seed, level)
    return {"difference": sum(diff) / len(diff) if diff else None, "ci": list(ci) if ci else None}


def _mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def summarize(scored: Sequence[Scored], resamples: int = 1000, seed: int = 0) -> dict:
    """Every metric of one model over a list of scored predictions (rates in [0, 1]; None where undefined)."""
    n = len(scored)
    with_number = [s for s in scored if s.has_number]
    abs_err = [float(abs(s.extraction.value - s.gold)) for s in with_number]
    log_err = [abs(signed_log(s.extraction.value) - signed_log(s.gold)) for s in with_number]
    per_place: dict[int, list[bool]] = {}
    for s in scored:
        for p, ok in s.places.items():
            per_place.setdefault(p, []).append(ok)
    all_places = [ok for s in scored for ok in s.places.values()]
    rules = {r: 0 for r in RULES}
    for s in scored:
        rules[s.extraction.rule] = rules.get(s.extraction.rule, 0) + 1
    return {
        "n": n,
        **_with_interval(EXACT_MATCH, [s.exact for s in scored], resamples, seed),
        **_with_interval(TOLERANCE_MATCH, [s.tolerance for s in scored], resamples, seed),
        NO_NUMBER.key: (n - len(with_number)) / n if n else None,
        "n_with_number": len(with_number),
        MAE.key: _mean(abs_err),
        LOG_MAE.key: _mean(log_err),
        DIGIT_ACCURACY.key: _mean(all_places),
        "per_place": {
            place_name(p): {"place": p, "accuracy": _mean(v), "n": len(v)}
            for p, v in sorted(per_place.items(), key=lambda kv: -kv[0])
        },
        "rules": rules,
        **harness_metrics(scored, resamples, seed),
        "bootstrap": {"resamples": resamples, "seed": seed, "level": 0.95},
    }


def _with_interval(m: Metric, values: Sequence[bool | float], resamples: int, seed: int) -> dict:
    """``m``'s mean over ``values`` and its percentile bootstrap interval."""
    ci = bootstrap_ci(values, resamples, seed)
    return {m.key: _mean(values), f"{m.key}_ci": list(ci) if ci else None}


def harness_metrics(scored: Sequence[Scored], resamples: int, seed: int) -> dict:
    """lm-evaluation-harness's strict-match and flexible-extract rates with their intervals (None without gold
    texts), and the mean of a generated task's own score (None for other sources)."""
    out: dict = {}
    for m, attr in ((STRICT_MATCH, "strict"), (FLEXIBLE_EXTRACT, "flexible")):
        out.update(_with_interval(m, [getattr(s, attr) for s in scored if getattr(s, attr) is not None], resamples,
                                  seed))
    out[TASK_SCORE.key] = _mean([s.task_score for s in scored if s.task_score is not None])
    return out


def place_order(places: Iterable[int]) -> list[int]:
    """Highest integer place first, then tenths, hundredths, ..."""
    return sorted(set(places), key=lambda p: -p)


def flags(scored: Sequence[Scored]) -> tuple[list[float], ...]:
    """Each PAIRED metric's value per problem (exact, tolerance match), as 0/1."""
    return tuple([float(getattr(s, m.per_problem)) for s in scored] for m in PAIRED)


def differences(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], resamples: int) -> dict:
    """b minus a in each PAIRED metric (paired bootstrap over the same problems): ``flags`` tuples, or
    per-problem rates averaged over seeds."""
    return {m.key: paired_difference(x, y, resamples, BOOTSTRAP_SEED) for m, x, y in zip(PAIRED, a, b)}
