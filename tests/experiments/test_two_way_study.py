"""A study that decides on the two-way (seed x problem) interval, with a calibrator that gates it (issue 54)."""

from __future__ import annotations

import pytest

from delft.experiments.seed_level import seed_analysis, verdict_lines, verdicts
from delft.experiments.seed_tests import holm, two_way_test

N = 200


def _model(recipe: str, seed: int, right: set[int]) -> dict:
    return {"recipe": recipe, "seed": seed, "predictions": [{"exact": i in right, "index": i} for i in range(N)]}


def _report(calibrator_right: int, arm_right: int, decide: str = "two_way") -> dict:
    """CE right on problems 0..99 on every seed; the calibrator on 0..calibrator_right-1 (a cost shared by every
    seed), the arm on its own count; seed 2 of each varies by one problem, so there is a spread."""
    models = []
    for s in range(3):
        models.append(_model("ce", s, set(range(100 + (s == 2)))))
        models.append(_model("del", s, set(range(calibrator_right + (s == 1)))))
        models.append(_model("del_prob", s, set(range(arm_right - (s == 0)))))
    return {"settings": {"decide": decide, "calibrators": ["del"]},
            "evals": {"held_out": {"settings": {"mode": "greedy", "reference": "ce"}, "problems": [{}] * N,
                                   "models": models}}}


def test_the_two_way_interval_decides_and_the_calibrator_stays_out_of_holms_family():
    report = _report(calibrator_right=90, arm_right=100)
    rows = seed_analysis(report)
    cal, arm = (next(r for r in rows if r["recipe"] == name) for name in ("del", "del_prob"))
    ref = [[float(i < 100 + (s == 2)) for i in range(N)] for s in range(3)]
    mine = [[float(i < 100 - (s == 0)) for i in range(N)] for s in range(3)]
    expected = two_way_test(ref, mine)
    assert arm["decides"] == "two_way" and arm["two_way"]["ci"] == pytest.approx(expected["ci"])
    assert arm["two_way"]["p"] == pytest.approx(expected["p"])
    assert cal["family"] == "calibrator" and cal["holm_p"] is None
    assert arm["holm_p"] == pytest.approx(holm([arm["two_way"]["p"]])[0])  # a family of one: the arm alone
    v = verdicts(rows, [], 2.5, True, ["del"], "two_way")
    assert v["calibrators"]["del"][0]["moved"] == "down"  # 10 points below on every seed
    assert v["arms"][0]["verdict"] == "equivalent" and "TOST" in v["arms"][0]["why"]
    lines = verdict_lines(v)
    first = next(i for i, line in enumerate(lines) if line.startswith("- "))
    assert lines[first].startswith("- Calibrator **del**") and "the design is sensitive" in lines[first]
    # no positive control, but the calibrator moved: said in the rules paragraph, not as a line of its own
    assert "the calibrator that moved down is what shows" in lines[2] and "declares no control" not in "\n".join(lines)
    assert all(line.startswith(("## ", "Rules applied", "- ")) or not line for line in lines), lines


def test_a_calibrator_that_does_not_move_down_makes_the_study_insensitive():
    rows = seed_analysis(_report(calibrator_right=100, arm_right=100))
    v = verdicts(rows, [], 2.5, True, ["del"], "two_way")
    assert v["calibrators"]["del"][0]["moved"] == "no"
    assert v["arms"][0]["verdict"] == "not readable" and "insensitive" in v["arms"][0]["why"]
    lines = verdict_lines(v)
    assert "the design is insensitive here" in "\n".join(lines)
    assert "declares no control" in lines[2] and "the calibrator that moved down" not in "\n".join(lines)
