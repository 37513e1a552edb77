"""Seed-level analysis and multiple comparisons: the hierarchical bootstrap, the t interval over seeds, Holm."""

from __future__ import annotations

import pytest

from delft.evaluation.metrics import hierarchical_difference, holm, seed_level_difference


def test_holm_on_a_worked_example():
    # sorted 0.01, 0.02, 0.03, 0.5 -> x4, x3, x2, x1, kept monotone: 0.04, 0.06, 0.06, 0.5
    assert holm([0.03, 0.01, 0.5, 0.02]) == pytest.approx([0.06, 0.04, 0.5, 0.06])
    assert holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []


def test_seed_level_difference_is_a_t_interval_over_seeds():
    ref = [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]]  # means 0.5, 0.75, 0.25
    arm = [[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]  # means 0.75, 1.0, 0.5: +0.25 every seed
    d = seed_level_difference(ref, arm)
    assert d["per_seed"] == [0.25, 0.25, 0.25] and d["difference"] == pytest.approx(0.25)
    assert d["ci"] == pytest.approx([0.25, 0.25])  # no spread over seeds
    uneven = seed_level_difference(ref, [[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]])  # +0.5, 0, 0
    half = 4.303 * (1 / 3) ** 0.5 * 0.5 / 3 ** 0.5  # t(0.975, 2) x sd / sqrt(3), sd = 0.5 / sqrt(3)
    assert uneven["ci"] == pytest.approx([1 / 6 - half, 1 / 6 + half])
    assert seed_level_difference(ref[:1], arm[:1])["ci"] is None


def test_the_hierarchical_bootstrap_sees_seed_variance():
    same = [[0.0, 1.0] * 50] * 3
    d = hierarchical_difference(same, same, 500)
    assert d["difference"] == 0 and d["ci"] == [0, 0] and d["p"] == 1.0
    ref = [[0.0] * 100] * 4
    steady = [[1.0] * 20 + [0.0] * 80] * 4  # +20 points on every seed
    noisy = [[1.0] * 40 + [0.0] * 60, [0.0] * 100, [1.0] * 40 + [0.0] * 60, [0.0] * 100]  # +20 on average
    s, n = hierarchical_difference(ref, steady, 1000), hierarchical_difference(ref, noisy, 1000)
    assert s["difference"] == pytest.approx(0.2) == n["difference"]
    assert n["ci"][1] - n["ci"][0] > s["ci"][1] - s["ci"][0]  # seed variance widens the interval
    assert s["p"] < 0.01 and n["p"] > s["p"]
    assert hierarchical_difference(ref, steady, 1000, seed=3) == hierarchical_difference(ref, steady, 1000, seed=3)
