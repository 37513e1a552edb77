"""Metrics over scored answers: percentile and paired bootstrap intervals, one model's summary (exact and
tolerance match, errors, per-place digit accuracy), paired differences, and the smallest detectable
difference of a paired comparison.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from delft.evaluation.problems import BOOTSTRAP_SEED
from delft.numbers.answers import RULES, Scored, signed_log
from delft.numbers.digits import place_name


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
    exact = [s.exact for s in scored]
    tol = [s.tolerance for s in scored]
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
    ci = bootstrap_ci(exact, resamples, seed)
    tci = bootstrap_ci(tol, resamples, seed)
    return {
        "n": n,
        "exact_match": _mean(exact),
        "exact_match_ci": list(ci) if ci else None,
        "tolerance_match": _mean(tol),
        "tolerance_match_ci": list(tci) if tci else None,
        "no_number_rate": (n - len(with_number)) / n if n else None,
        "n_with_number": len(with_number),
        "mae": _mean(abs_err),
        "log_mae": _mean(log_err),
        "digit_accuracy": _mean(all_places),
        "per_place": {
            place_name(p): {"place": p, "accuracy": _mean(v), "n": len(v)}
            for p, v in sorted(per_place.items(), key=lambda kv: -kv[0])
        },
        "rules": rules,
        **harness_metrics(scored, resamples, seed),
        "bootstrap": {"resamples": resamples, "seed": seed, "level": 0.95},
    }


def harness_metrics(scored: Sequence[Scored], resamples: int, seed: int) -> dict:
    """lm-evaluation-harness's strict-match and flexible-extract rates with their intervals (None without gold
    texts), and the mean of a generated task's own score (None for other sources)."""
    out: dict = {}
    for key, attr in (("strict_match", "strict"), ("flexible_extract", "flexible")):
        values = [getattr(s, attr) for s in scored if getattr(s, attr) is not None]
        ci = bootstrap_ci(values, resamples, seed)
        out[key], out[f"{key}_ci"] = _mean(values), list(ci) if ci else None
    out["task_score"] = _mean([s.task_score for s in scored if s.task_score is not None])
    return out


def place_order(places: Iterable[int]) -> list[int]:
    """Highest integer place first, then tenths, hundredths, ..."""
    return sorted(set(places), key=lambda p: -p)


def flags(scored: Sequence[Scored]) -> tuple[list[float], list[float]]:
    """(exact, tolerance) match per problem, as 0/1."""
    return [float(s.exact) for s in scored], [float(s.tolerance) for s in scored]


def differences(a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]],
                resamples: int) -> dict:
    """b minus a in exact and tolerance match (paired bootstrap over the same problems): ``flags`` pairs, or
    per-problem rates averaged over seeds."""
    return {"exact_match": paired_difference(a[0], b[0], resamples, BOOTSTRAP_SEED),
            "tolerance_match": paired_difference(a[1], b[1], resamples, BOOTSTRAP_SEED)}


# The minimal detectable difference: a two-sided 5 % test with 80 % power sees a true difference of
# (z_0.975 + z_0.8) standard errors; the standard error is read off the paired bootstrap's 95 % interval.
Z_LEVEL, Z_POWER = 1.959964, 0.841621
UNDETECTABLE = float("inf")  # mdd of a comparison whose answers never differ: it can detect nothing


def mdd(ci: Optional[Sequence[float]]) -> Optional[float]:
    """The smallest true difference a paired comparison with this 95 % interval detects with 80 % power;
    None without an interval, and ``UNDETECTABLE`` when the interval has no width: no pair of answers differed
    (every model scored 0, say), so the set carries no information about a difference, not perfect power."""
    if not ci:
        return None
    width = ci[1] - ci[0]
    if width <= 0:
        return UNDETECTABLE
    return (Z_LEVEL + Z_POWER) * width / (2 * Z_LEVEL)


# ----------------------------------------------------------------------------- seeds as the unit, and many tests


def hierarchical_difference(ref: Sequence[Sequence[float]], arm: Sequence[Sequence[float]], resamples: int = 2000,
                            seed: int = 0, level: float = 0.95) -> dict:
    """arm minus ref with seed variance in the interval: each resample draws seeds (pairs: seed s of both), then
    problems (the same ones for both), with replacement. ``ref`` / ``arm``: per seed, a per-problem score list.

    Returns the difference of the means, its percentile interval and a two-sided bootstrap p-value (twice the
    share of resampled differences on the far side of 0, at most 1)."""
    import numpy as np

    a, b = np.asarray(ref, dtype=np.float64), np.asarray(arm, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError("hierarchical_difference needs [seeds x problems] scores of the same shape for both")
    rng = np.random.default_rng(seed)
    n_seeds, n = a.shape
    diffs = np.empty(resamples)
    for r in range(resamples):
        s = rng.integers(0, n_seeds, size=n_seeds)
        p = rng.integers(0, n, size=n)
        diffs[r] = (b[s][:, p] - a[s][:, p]).mean()
    alpha = (1 - level) / 2
    lo, hi = np.quantile(diffs, [alpha, 1 - alpha])
    point = float((b - a).mean())
    far = (diffs <= 0).mean() if point > 0 else (diffs >= 0).mean()
    return {"difference": point, "ci": [float(lo), float(hi)], "p": float(min(1.0, 2 * far))}


# Student's t 97.5 % quantiles for 1-10 degrees of freedom (a study has few seeds); the normal's beyond.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_975(df: int) -> float:
    return T_975[df - 1] if df <= len(T_975) else Z_LEVEL


def seed_level_difference(ref: Sequence[Sequence[float]], arm: Sequence[Sequence[float]]) -> dict:
    """The seed as the unit: each seed's mean difference, their mean and a t interval over seeds (n - 1 degrees
    of freedom; None for one seed). Wide with few seeds, as it should be."""
    per_seed = [float(sum(y) / len(y) - sum(x) / len(x)) for x, y in zip(ref, arm)]
    k = len(per_seed)
    mean = sum(per_seed) / k
    if k < 2:
        return {"per_seed": per_seed, "difference": mean, "ci": None}
    sd = (sum((d - mean) ** 2 for d in per_seed) / (k - 1)) ** 0.5
    half = t_975(k - 1) * sd / k ** 0.5
    return {"per_seed": per_seed, "difference": mean, "ci": [mean - half, mean + half]}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``pvalues`` (family-wise error), in their order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
