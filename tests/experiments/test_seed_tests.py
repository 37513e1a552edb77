"""The tests with the seed as the unit (delft.experiments.seed_tests): hand-worked values, brute-force oracles, and
the error rates that decided which test decides."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from scipy import stats

from delft.experiments.seed_tests import (
    detectable_difference,
    hierarchical_bootstrap,
    holm,
    sign_flip_test,
    t_power,
    t_quantile,
    spread_upper_bound,
    t_test,
    tost,
    two_way_test,
    wilcoxon_test,
)


def test_holm_on_a_worked_example():
    # sorted 0.01, 0.02, 0.03, 0.5 -> x4, x3, x2, x1, kept monotone: 0.04, 0.06, 0.06, 0.5
    assert holm([0.03, 0.01, 0.5, 0.02]) == pytest.approx([0.06, 0.04, 0.5, 0.06])
    assert holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []


def test_t_quantiles_are_exact_not_the_normals():
    assert t_quantile(0.975, 11) == pytest.approx(2.201, abs=5e-4)  # the old table gave 1.96 beyond 10
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=5e-4)
    assert t_quantile(0.975, 30) == pytest.approx(2.042, abs=5e-4)


def test_the_t_test_over_seeds_on_a_worked_example():
    t = t_test([0.5, 0.0, 0.0])  # mean 1/6, sd 0.5 / sqrt(3), se 1/6: t = 1 on 2 degrees of freedom
    half = 4.302653 * (1 / 6)
    assert t["difference"] == pytest.approx(1 / 6) and t["ci"] == pytest.approx([1 / 6 - half, 1 / 6 + half])
    assert t["p"] == pytest.approx(1 - 1 / 3 ** 0.5)  # two-sided p of t = 1 at 2 df: 1 - t / sqrt(t^2 + 2)
    assert t_test([0.25])["ci"] is None and t_test([0.25])["p"] is None  # one seed: no test over seeds
    flat = t_test([0.2, 0.2, 0.2])  # no spread: the t statistic is undefined, p is the sign flip's, never 0
    assert flat["ci"] is None and flat["p"] == pytest.approx(2 / 8)
    assert flat["p_from"].startswith("sign")


def test_the_sign_flip_test_against_brute_force():
    rng = np.random.default_rng(1)
    for k in (2, 3, 5, 7):
        d = rng.normal(0.02, 0.05, size=k)
        means = [abs(np.dot(s, d) / k) for s in product((1, -1), repeat=k)]
        oracle = sum(m >= abs(d.mean()) - 1e-15 for m in means) / 2 ** k
        got = sign_flip_test(d)
        assert got["p"] == pytest.approx(oracle) and got["exact"] and got["smallest_possible_p"] == 2 / 2 ** k
    assert sign_flip_test([0.1, 0.2, 0.3, 0.4])["p"] == 2 / 16  # the floor 4 seeds allow: 0.125, never below
    many = sign_flip_test([0.01] * 20)  # beyond the exact range: sampled, (1 + count) / (B + 1), never 0
    assert not many["exact"] and many["p"] > 0


def test_bootstrap_p_values_are_never_zero():
    ref = [[0.0] * 100] * 4
    steady = [[1.0] * 20 + [0.0] * 80] * 4  # +20 points on every seed: no resample reaches 0
    b = hierarchical_bootstrap(ref, steady, 999)
    assert b["p"] == pytest.approx(2 * 1 / 1000) and b["p"] > 0  # (1 + 0) / (B + 1), both sides
    same = [[0.0, 1.0] * 50] * 3
    assert hierarchical_bootstrap(same, same, 500)["p"] == 1.0


def _null_rejections(seeds: int, sims: int, spread: float) -> tuple[float, float]:
    """Share of null studies (true mean effect 0, but the effect varies by seed) that each test calls
    significant at 0.05: the t test over seeds, and the hierarchical bootstrap."""
    rng = np.random.default_rng(7)
    t_hits = boot_hits = 0
    for i in range(sims):
        effect = rng.normal(0.0, spread, size=seeds)
        ref = (rng.random((seeds, 150)) < 0.4).astype(float)
        arm = (rng.random((seeds, 150)) < (0.4 + effect)[:, None]).astype(float)
        per_seed = arm.mean(axis=1) - ref.mean(axis=1)
        t_hits += t_test(per_seed)["p"] < 0.05
        boot_hits += hierarchical_bootstrap(ref, arm, 300, seed=i)["p"] < 0.05
    return t_hits / sims, boot_hits / sims


def test_the_t_test_keeps_its_error_rate_where_the_bootstrap_does_not():
    """Why the t test decides: with 2 seeds and an effect that varies by seed (sd 15 points), the bootstrap over
    seeds then problems calls a null difference significant far more often than 5 %; the t test stays near 5 %."""
    t_rate, boot_rate = _null_rejections(seeds=2, sims=300, spread=0.15)
    assert t_rate < 0.08 and boot_rate > 0.13


def test_the_detectable_difference_has_80_percent_power_with_the_seed_as_the_unit():
    assert t_power(0.0, 0.05, 4) == pytest.approx(0.05, abs=1e-6)  # no effect: it rejects at its level
    d = detectable_difference(0.05, 10)
    assert t_power(d, 0.05, 10) == pytest.approx(0.8, abs=1e-6)
    # the textbook approximation (t_0.975 + t_0.8) sd / sqrt(k) is close for 10 seeds
    assert d == pytest.approx((2.262 + 0.883) * 0.05 / 10 ** 0.5, rel=0.05)
    assert detectable_difference(0.05, 2) > 5 * d  # 2 seeds see only large effects
    assert detectable_difference(0.05, 1) is None and detectable_difference(None, 5) is None
    assert detectable_difference(0.0, 4) is None  # a floor: no answer differs, nothing to compute power from
    rng = np.random.default_rng(3)  # Monte Carlo: the t test finds that difference in ~80 % of studies
    hits = sum(t_test(rng.normal(d, 0.05, size=10))["p"] < 0.05 for _ in range(2000))
    assert 0.76 < hits / 2000 < 0.84


# A seed x problem table of paired differences (arm minus reference), worked by hand below.
TABLE = [[2, 0, 1, 1],
         [1, -1, 0, 0],
         [3, 1, 2, 0]]


def test_the_two_way_interval_on_a_hand_worked_3_by_4_table():
    # seed means 1, 0, 3/2; problem means 2, 0, 1, 1/3; grand mean 5/6
    # MS_seed = 4 x (1/36 + 25/36 + 16/36) / 2 = 7/3; MS_problem = 3 x (49 + 25 + 1 + 9) / 36 / 3 = 7/3
    # SS_total = 22 - 12 x 25/36 = 41/3; SS_residual = 41/3 - 14/3 - 7 = 2 over 6 df: MS_residual = 1/3
    # Var(mean) = (7/3 + 7/3 - 1/3) / 12 = 13/36; Satterthwaite df = (13/3)^2 / ((7/3)^2/2 + (7/3)^2/3 + (1/3)^2/6)
    #           = 1014/246
    ref = np.zeros((3, 4))
    w = two_way_test(ref, TABLE)
    df = 1014 / 246
    se = 13 ** 0.5 / 6
    half = float(stats.t.ppf(0.975, df)) * se
    assert w["difference"] == pytest.approx(5 / 6)
    assert w["mean_squares"] == pytest.approx({"seed": 7 / 3, "problem": 7 / 3, "residual": 1 / 3})
    assert w["se"] == pytest.approx(se) and w["df"] == pytest.approx(df)
    assert w["ci"] == pytest.approx([5 / 6 - half, 5 / 6 + half])
    assert w["components"] == pytest.approx({"seed": 0.5, "problem": 2 / 3, "residual": 1 / 3})
    # the seeds-only t test sees only MS_seed / 12 = 7/36 of variance: narrower than the two-way 13/36
    t = t_test([1.0, 0.0, 1.5])
    assert (t["ci"][1] - t["ci"][0]) / (2 * t_quantile(0.975, 2)) == pytest.approx((7 / 36) ** 0.5)


def test_a_component_below_the_residual_counts_as_zero_never_a_negative_variance():
    flat_seeds = [[1, 0, 1, 0], [1, 0, 1, 0], [1, 0, 1, 0]]  # MS_seed 0 < MS_residual 0: only problems vary
    w = two_way_test(np.zeros((3, 4)), flat_seeds)
    assert w["components"]["seed"] == 0 and w["se"] == pytest.approx((w["mean_squares"]["problem"] / 12) ** 0.5)
    assert w["df"] == pytest.approx(3)  # MS_problem alone: its own 3 degrees of freedom
    assert two_way_test(np.zeros((1, 4)), [[1, 0, 1, 0]])["ci"] is None  # one seed: no seed variance to estimate


def test_the_two_way_interval_covers_where_the_seeds_only_t_interval_does_not():
    # Seeds barely differ, problems carry the spread (the LoRA regime): the seeds-only t interval treats the
    # problems as fixed and misses the true mean far more often than 5 %; the two-way interval keeps its level.
    rng = np.random.default_rng(54)
    reps, seeds, problems = 400, 5, 60
    hits = {"two_way": 0, "t": 0}
    for _ in range(reps):
        d = (0.1 * rng.standard_normal((seeds, 1)) + 1.0 * rng.standard_normal((1, problems))
             + 0.5 * rng.standard_normal((seeds, problems)))
        w, t = two_way_test(np.zeros_like(d), d), t_test(d.mean(axis=1))
        hits["two_way"] += w["ci"][0] <= 0 <= w["ci"][1]
        hits["t"] += t["ci"][0] <= 0 <= t["ci"][1]
    assert 0.92 <= hits["two_way"] / reps <= 0.98
    assert hits["t"] / reps < 0.8


def test_tost_is_the_90_percent_interval_inside_the_margin():
    inside = tost(0.005, 0.01, 30, 0.025)  # 0.005 +- 1.697 x 0.01: inside +-0.025
    assert inside["equivalent"] and inside["p"] < 0.05
    assert inside["ci"][0] > -0.025 and inside["ci"][1] < 0.025
    p_upper = float(stats.t.cdf((0.005 - 0.025) / 0.01, 30))  # the nearer bound decides
    assert inside["p"] == pytest.approx(p_upper)
    wide = tost(0.005, 0.02, 30, 0.025)
    assert not wide["equivalent"] and wide["ci"][1] > 0.025
    assert tost(0.0, None, None, 0.025)["p"] is None  # no spread: no test, never "equivalent"


def test_wilcoxon_and_the_spread_bound():
    w = wilcoxon_test([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.0])  # the zero seed is dropped: 8 left
    assert w["nonzero"] == 8 and w["p"] == pytest.approx(2 / 2 ** 8) and w["smallest_possible_p"] == w["p"]
    assert spread_upper_bound(1.0, 3) == pytest.approx(6.28, abs=0.01)  # 3 seeds: 6.3x the estimate
    assert spread_upper_bound(1.0, 10) == pytest.approx(1.826, abs=0.01)
