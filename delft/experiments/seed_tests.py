"""Tests with the training seed as the unit: what decides a study's verdicts.

A digit loss's effect varies from seed to seed (initial weights, data order), so a study has as many independent
observations as it has seeds, not seeds x problems. The tests here are over each seed's mean difference:

- ``t_test``: the paired t test over seeds (n - 1 degrees of freedom, exact t quantiles). It decides.
- ``sign_flip_test``: the exact randomisation test that flips the sign of each seed's difference (all 2^k
  assignments). Free of any normality assumption, but it cannot go below 2 / 2^k: with 4 seeds 0.125, so it cannot
  reject anything at 0.05 below 6 seeds. It is reported beside the t test as a check, not used to decide.
- ``hierarchical_bootstrap``: seeds, then problems, resampled. Descriptive only: with 2-4 seeds it resamples from
  so few seeds that its interval is too narrow (p < 0.05 in 14-35 % of null cases with 2 seeds once the effect
  varies by seed), so it is labelled for what it resamples and never decides.
- ``two_way_test``: where every seed is scored on the same problems, the seed x problem table of paired
  differences read as a two-way random-effects ANOVA (seed and problem effects, one observation per cell): the
  mean's variance is seed variance / seeds + problem variance / problems + residual / (seeds x problems), with
  Satterthwaite's degrees of freedom. The seeds-only t test treats the problem set as fixed, so where the seeds
  barely differ (LoRA) and the problems carry the spread, its interval is too narrow for claims about "problems
  like these"; a study that states ``decide: two_way`` decides on this one.
- ``wilcoxon_test``: the exact signed-rank test over seeds (scipy), beside the sign-flip test.
- ``tost``: equivalence by two one-sided tests at a stated margin (the 90 % interval inside +-margin).
- ``holm``: Holm's step-down adjustment over a study's comparisons.
- ``detectable_difference``: the smallest true mean difference the t test detects with 80 % power, from a
  between-seed spread (stated, piloted or observed), solved on the noncentral t distribution.
"""

from __future__ import annotations

from itertools import product
from typing import Optional, Sequence

import numpy as np
from scipy import integrate, optimize, stats

LEVEL = 0.95  # intervals are 95 %
ALPHA = 0.05  # the family-wise level of the verdicts (on Holm-adjusted p-values)
POWER = 0.80  # the power a detectable difference is computed for
EXACT_SIGN_FLIPS = 16  # up to 2^16 sign assignments enumerated; beyond that a seeded sample of them
SIGN_FLIP_SAMPLES = 20_000


def seed_differences(ref: Sequence[Sequence[float]], arm: Sequence[Sequence[float]]) -> list[float]:
    """Each seed's mean difference, arm minus ref (per seed, a per-problem score list of each)."""
    if len(ref) != len(arm):
        raise ValueError("seed_differences needs the same seeds on both sides")
    return [float(np.mean(y) - np.mean(x)) for x, y in zip(ref, arm)]


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (exact, not the normal's: 2.201 at 11 degrees of freedom, not 1.96)."""
    return float(stats.t.ppf(q, df))


def t_test(per_seed: Sequence[float], level: float = LEVEL) -> dict:
    """The paired t test over seeds: mean difference, its t interval and two-sided p (None with one seed). With no
    spread at all (every seed the same difference) the t statistic is undefined: there is no interval (a zero-width
    one would claim certainty two equal seeds cannot give), and p is the exact sign-flip test's, never 0
    (``p_from`` says so)."""
    d = np.asarray(per_seed, dtype=np.float64)
    k, mean = len(d), float(d.mean())
    if k < 2:
        return {"per_seed": [float(x) for x in d], "difference": mean, "ci": None, "p": None, "df": 0, "p_from": None}
    sd = float(d.std(ddof=1))
    if sd <= 1e-12 * max(1.0, abs(mean)):  # equal differences, up to the rounding of their mean
        return {"per_seed": [float(x) for x in d], "difference": mean, "ci": None, "p": sign_flip_test(d)["p"],
                "df": k - 1, "p_from": "sign flip: no spread over seeds"}
    se = sd / k ** 0.5
    half = t_quantile(1 - (1 - level) / 2, k - 1) * se
    p = float(2 * stats.t.sf(abs(mean) / se, k - 1))
    return {"per_seed": [float(x) for x in d], "difference": mean, "ci": [mean - half, mean + half], "p": p,
            "df": k - 1, "p_from": "t", "se": se}


def sign_flip_test(per_seed: Sequence[float], samples: int = SIGN_FLIP_SAMPLES, seed: int = 0) -> dict:
    """The exact sign-flip (randomisation) test over seeds: the share of sign assignments whose mean is at least as
    far from 0 as the observed one. The observed assignment is one of them, so p is never 0; its floor, 2 / 2^k,
    is returned too. Beyond EXACT_SIGN_FLIPS seeds, ``samples`` random assignments, p = (1 + count) / (samples + 1)."""
    d = np.asarray(per_seed, dtype=np.float64)
    k = len(d)
    observed = abs(d.mean())
    tol = 1e-12 * max(1.0, observed)  # ties within float rounding count as "as far"
    if k <= EXACT_SIGN_FLIPS:
        signs = np.array(list(product((1.0, -1.0), repeat=k)))
        far = int((np.abs(signs @ d / k) >= observed - tol).sum())
        p, exact = far / len(signs), True
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(samples, k))
        far = int((np.abs(signs @ d / k) >= observed - tol).sum())
        p, exact = (1 + far) / (samples + 1), False
    return {"p": float(min(1.0, p)), "smallest_possible_p": float(min(1.0, 2 / 2 ** k)), "exact": exact}


def hierarchical_bootstrap(ref: Sequence[Sequence[float]], arm: Sequence[Sequence[float]], resamples: int = 2000,
                           seed: int = 0, level: float = LEVEL) -> dict:
    """arm minus ref, resampling seeds (pairs: seed s of both), then problems (the same ones for both), with
    replacement: the difference of the means, a percentile interval and a two-sided bootstrap p-value computed as
    (1 + count) / (B + 1) per side, so never 0. Descriptive: see the module's docstring."""
    a, b = np.asarray(ref, dtype=np.float64), np.asarray(arm, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError("hierarchical_bootstrap needs [seeds x problems] scores of the same shape for both")
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
    far = int((diffs <= 0).sum()) if point > 0 else int((diffs >= 0).sum())
    return {"difference": point, "ci": [float(lo), float(hi)],
            "p": float(min(1.0, 2 * (1 + far) / (resamples + 1))), "resamples": "seeds, then problems"}


def two_way_test(ref: Sequence[Sequence[float]], arm: Sequence[Sequence[float]], level: float = LEVEL) -> dict:
    """arm minus ref on a [seeds x problems] table (every seed scored on the same problems): the grand mean, its
    two-way random-effects standard error and interval (Satterthwaite degrees of freedom), the two-sided p and the
    variance components. A component whose mean square falls below the residual's is taken as 0, so the variance
    is never negative. None for the interval and p with fewer than 2 seeds or 2 problems, or no variation at all."""
    d = np.asarray(arm, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError("two_way_test needs [seeds x problems] scores")
    s, n = d.shape
    mean = float(d.mean())
    empty = {"difference": mean, "ci": None, "p": None, "se": None, "df": None, "components": None,
             "seeds": s, "problems": n}
    if s < 2 or n < 2:
        return empty
    ms, dfs = _mean_squares(d)
    use = [ms["seed"] > ms["residual"], ms["problem"] > ms["residual"]]
    # (coefficient of each mean square) in seeds x problems x Var(mean): MS_seed + MS_problem - MS_residual with
    # both components kept; a component taken as 0 drops its mean square and the residual's minus sign with it
    coef = (float(use[0]), float(use[1]), float(1 - use[0] - use[1]))
    parts = [c * m for c, m in zip(coef, (ms["seed"], ms["problem"], ms["residual"]))]
    var = sum(parts) / (s * n)
    if var <= 1e-24 * max(1.0, mean * mean):
        return empty
    df = sum(parts) ** 2 / sum(x * x / f for x, f in zip(parts, dfs) if x)
    se = var ** 0.5
    half = float(stats.t.ppf(1 - (1 - level) / 2, df)) * se
    components = {"seed": max(0.0, (ms["seed"] - ms["residual"]) / n),
                  "problem": max(0.0, (ms["problem"] - ms["residual"]) / s), "residual": ms["residual"]}
    return {**empty, "ci": [mean - half, mean + half], "p": float(2 * stats.t.sf(abs(mean) / se, df)), "se": se,
            "df": float(df), "components": components, "mean_squares": ms}


def _mean_squares(d: np.ndarray) -> tuple[dict, tuple[int, int, int]]:
    """The two-way ANOVA's mean squares of a [seeds x problems] table (one observation per cell) and their
    degrees of freedom."""
    s, n = d.shape
    grand, by_seed, by_problem = d.mean(), d.mean(axis=1), d.mean(axis=0)
    residual = d - by_seed[:, None] - by_problem[None, :] + grand
    dfs = (s - 1, n - 1, (s - 1) * (n - 1))
    ms = {"seed": float(n * ((by_seed - grand) ** 2).sum() / dfs[0]),
          "problem": float(s * ((by_problem - grand) ** 2).sum() / dfs[1]),
          "residual": float((residual ** 2).sum() / dfs[2])}
    return ms, dfs


def tost(difference: float, se: Optional[float], df: Optional[float], margin: float, alpha: float = ALPHA) -> dict:
    """Equivalence within +-``margin`` (same unit as ``difference``) by two one-sided t tests: p is the larger of
    the two one-sided p-values; equivalent when p < alpha, which is the (1 - 2 alpha) interval inside the margin.
    None without a standard error (one seed, or no spread)."""
    if se is None or df is None or se <= 0:
        return {"margin": margin, "p": None, "ci": None, "equivalent": False}
    lower = float(stats.t.sf((difference + margin) / se, df))  # H0: difference <= -margin
    upper = float(stats.t.cdf((difference - margin) / se, df))  # H0: difference >= +margin
    half = float(stats.t.ppf(1 - alpha, df)) * se
    p = max(lower, upper)
    return {"margin": margin, "p": p, "ci": [difference - half, difference + half], "equivalent": p < alpha}


def wilcoxon_test(per_seed: Sequence[float]) -> dict:
    """The exact Wilcoxon signed-rank test over seeds (zero differences dropped, as Wilcoxon's own rule), with its
    smallest possible p, 2 / 2^k over the k nonzero seeds. None with no nonzero seed."""
    d = [x for x in per_seed if abs(x) > 1e-12]
    if not d:
        return {"p": None, "smallest_possible_p": None, "nonzero": 0}
    p = float(stats.wilcoxon(d, method="exact" if len(d) <= 50 else "approx").pvalue)
    return {"p": p, "smallest_possible_p": float(min(1.0, 2 / 2 ** len(d))), "nonzero": len(d)}


def spread_upper_bound(sd: float, seeds: int, level: float = LEVEL) -> float:
    """The upper end of the two-sided ``level`` interval of a standard deviation estimated from ``seeds`` values
    (chi-square with seeds - 1 degrees of freedom): 6.3 times the estimate with 3 seeds at 95 %, so a plan built
    on a small pilot's spread does not promise what the pilot only happened to show."""
    return float(sd * ((seeds - 1) / stats.chi2.ppf((1 - level) / 2, seeds - 1)) ** 0.5)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``pvalues`` (family-wise error), in their order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def t_power(difference: float, spread: float, seeds: int, alpha: float = ALPHA) -> float:
    """The two-sided paired t test's power to find a true mean ``difference`` over ``seeds`` seeds whose
    differences spread with standard deviation ``spread`` (the noncentral t distribution)."""
    df, ncp = seeds - 1, difference / spread * seeds ** 0.5
    crit = t_quantile(1 - alpha / 2, df)

    # T = (Z + ncp) / sqrt(V / df), V ~ chi2(df): integrated over V directly, because scipy's noncentral t returns
    # NaN in its tails at 1 degree of freedom (2 seeds), where a plan needs it most
    def rejects(v: float) -> float:
        c = crit * (v / df) ** 0.5
        return (stats.norm.sf(c - ncp) + stats.norm.cdf(-c - ncp)) * stats.chi2.pdf(v, df)

    return float(integrate.quad(rejects, 0, np.inf, limit=200)[0])


def detectable_difference(spread: Optional[float], seeds: int, alpha: float = ALPHA,
                          power: float = POWER) -> Optional[float]:
    """The smallest true mean difference the t test over ``seeds`` seeds finds with ``power`` at level ``alpha``
    when each seed's difference spreads with standard deviation ``spread``. None where it cannot be computed: one
    seed, no spread known, or none at all (seeds that all differ by the same amount, often 0 on a floor where no
    answer differs, show nothing a power could be computed from)."""
    if spread is None or seeds < 2 or not np.isfinite(spread) or spread <= 0:
        return None
    high = spread
    while t_power(high, spread, seeds, alpha) < power:
        high *= 2
    return float(optimize.brentq(lambda x: t_power(x, spread, seeds, alpha) - power, 0.0, high, xtol=1e-10))


def seed_spread(per_seed: Sequence[float]) -> Optional[float]:
    """The standard deviation of the seeds' differences (None with one seed)."""
    return float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else None
