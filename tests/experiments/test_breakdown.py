"""The study's secondary endpoints by group (delft.experiments.breakdown), on a hand-made study.json: five
problems, two recipes, two seeds, every group's numbers worked out by hand below."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest

from delft.experiments.breakdown import breakdown, breakdown_lines
from delft.numbers.answers import Extraction, score
from delft.numbers.digits import place_name

# (question, gold): digit counts 1, 2, 3, 2, 1; operations +, *, -, /, and one that is no synthetic problem
PROBLEMS = [("What is 2 + 3?", "5"), ("What is 12 * 4?", "48"), ("What is 7.5 - 1.25?", "6.25"),
            ("What is 10 / 4?", "2.5"), ("How many apples are left?", "7")]
SAID = {("ce", 0): ["5", "48", "6.25", "2.5", "7"],   # every answer right
        ("ce", 1): ["5", "48", "6.2", "3", None],     # 6.2 within 4 % of 6.25; 3 is not near 2.5; no number
        ("del", 0): ["6", "47", "6.25", "2.5", "7"],
        ("del", 1): ["5", "40", "6.25", "2.45", "7"]}  # 2.45 within 4 % of 2.5


def prediction(index: int, gold: str, said) -> dict:
    """A stored prediction as study.json keeps it, scored by delft's own scoring."""
    value = None if said is None else Decimal(said)
    s = score(Extraction(value, "none" if said is None else "last_number", said), Decimal(gold))
    return {"index": index, "gold": gold, "extracted": s.extraction.canonical, "matched_text": said,
            "rule": s.extraction.rule, "exact": s.exact, "tolerance": s.tolerance,
            "places": {place_name(p): ok for p, ok in s.places.items()}}


def report(problems=PROBLEMS, said=SAID) -> dict:
    models = [{"name": "base", "recipe": None, "seed": None, "predictions": []}]
    for (recipe, seed), answers in said.items():
        models.append({"name": f"{recipe}-seed{seed}", "recipe": recipe, "seed": seed,
                       "predictions": [prediction(i, gold, a) for i, ((_, gold), a) in enumerate(zip(problems,
                                                                                                      answers))]})
    return {"evals": {"held_out": {"settings": {"mode": "greedy", "reference": "ce"},
                                   "problems": [{"index": i, "question": q, "gold": g}
                                                for i, (q, g) in enumerate(problems)],
                                   "models": models},
                      "gold": {"settings": {"mode": "teacher_forced", "reference": "ce"}}}}


def by_group(b: dict, grouping: str) -> dict:
    return {g["group"]: g for g in b["groupings"][grouping]}


def test_the_scoring_the_hand_computations_rest_on():
    assert prediction(2, "6.25", "6.2")["tolerance"] and not prediction(2, "6.25", "6.2")["exact"]
    assert prediction(3, "2.5", "2.45")["tolerance"] and not prediction(3, "2.5", "3")["tolerance"]
    assert prediction(1, "48", "40")["places"] == {"tens": True, "units": False}


def test_groups_by_digit_count_with_seed_means_and_differences():
    (b,) = breakdown(report())  # the teacher-forced set has no predictions to group
    assert b["set"] == "held_out" and b["recipes"] == ["ce", "del"] and b["seeds"] == {"ce": 2, "del": 2}
    digits = by_group(b, "digits")
    assert list(digits) == ["1", "2", "3"] and [g["n"] for g in digits.values()] == [2, 2, 1]
    two = digits["2"]  # 48 and 2.5
    ce, dl, diff = two["recipes"]["ce"], two["recipes"]["del"], two["vs_reference"]["del"]
    # exact: ce 2/2 and 1/2 -> 0.75; del 47 and 2.5 (1/2), 40 and 2.45 (0/2) -> 0.25
    assert (ce["exact_match"], dl["exact_match"], diff["exact_match"]) == pytest.approx((0.75, 0.25, -0.5))
    # tolerance: del's 2.45 counts -> del 0.5 on both seeds
    assert (ce["tolerance_match"], dl["tolerance_match"]) == pytest.approx((0.75, 0.5))
    # digits right of the four in 48 and 2.5: ce 4 and 2, del 3 and 2
    assert (ce["digit_accuracy"], dl["digit_accuracy"], diff["digit_accuracy"]) == pytest.approx((0.75, 0.625,
                                                                                                  -0.125))
    # per place: units (48, 2.5) ce 2/2 then 1/2; del 1/2 both seeds. tenths (2.5): ce 1 then 0, del 1 then 0
    assert ce["per_place"]["units"]["accuracy"] == pytest.approx(0.75) and ce["per_place"]["units"]["n"] == 2
    assert dl["per_place"]["units"]["accuracy"] == pytest.approx(0.5)
    assert diff["per_place"] == pytest.approx({"tens": 0.0, "units": -0.25, "tenths": 0.0})

    def log_error(said: float, gold: float) -> float:
        return abs(math.log10(said + 1) - math.log10(gold + 1))

    ce_log = (0 + (0 + log_error(3, 2.5)) / 2) / 2
    del_log = ((log_error(47, 48) + 0) / 2 + (log_error(40, 48) + log_error(2.45, 2.5)) / 2) / 2
    assert (ce["log_mae"], dl["log_mae"], diff["log_mae"]) == pytest.approx((ce_log, del_log, del_log - ce_log))
    one = digits["1"]["recipes"]["ce"]  # seed 1 gave no number on the apples: its log-MAE is over 5 alone
    assert one["exact_match"] == pytest.approx(0.75) and one["log_mae"] == pytest.approx(0.0)
    three = digits["3"]
    assert three["recipes"]["ce"]["exact_match"] == pytest.approx(0.5)
    assert three["vs_reference"]["del"]["exact_match"] == pytest.approx(0.5)
    assert three["vs_reference"]["del"]["tolerance_match"] == pytest.approx(0.0)  # 6.2 is within tolerance


def test_groups_by_operation_from_the_stored_question():
    ops = by_group(breakdown(report())[0], "operation")
    assert list(ops) == ["+", "-", "*", "/", "other"] and all(g["n"] == 1 for g in ops.values())
    assert ops["*"]["recipes"]["ce"]["exact_match"] == 1.0 and ops["*"]["vs_reference"]["del"]["exact_match"] == -1.0
    assert ops["+"]["recipes"]["del"]["exact_match"] == pytest.approx(0.5)  # 6, then 5
    assert ops["other"]["recipes"]["ce"]["exact_match"] == pytest.approx(0.5)
    assert ops["other"]["vs_reference"]["del"]["exact_match"] == pytest.approx(0.5)


def test_the_groups_add_up_to_the_whole_set():
    """Weighted by their problems, the groups' exact match is the set's seed mean (from the stored flags)."""
    b = breakdown(report())[0]
    for recipe in ("ce", "del"):
        whole = sum(p["exact"] for (r, _), answers in SAID.items() if r == recipe
                    for p in (prediction(i, g, a) for i, ((_, g), a) in enumerate(zip(PROBLEMS, answers)))) / 10
        for grouping in ("digits", "operation"):
            groups = b["groupings"][grouping]
            total = sum(g["n"] * g["recipes"][recipe]["exact_match"] for g in groups) / len(PROBLEMS)
            assert total == pytest.approx(whole), (recipe, grouping)


def test_a_set_of_word_problems_is_grouped_by_digit_count_only():
    words = [("How many apples?", "5"), ("How far is it?", "48")]
    said = {("ce", 0): ["5", "48"], ("del", 0): ["5", "47"]}
    b = breakdown(report(words, said))[0]
    assert list(b["groupings"]) == ["digits"]
    assert by_group(b, "digits")["2"]["vs_reference"]["del"]["exact_match"] == -1.0


def test_the_summary_section_shows_each_group_and_difference():
    text = "\n".join(breakdown_lines(breakdown(report())))
    assert "## By the gold answer's digit count and by operation (descriptive)" in text
    assert "| digits | n | metric | ce | del | del - ce |" in text
    assert "| 2 | 2 | exact match % | 75.0 | 25.0 | -50.0 |" in text
    assert "| 2 | 2 | log-MAE |" in text and "| 3 | 1 | tolerance match % | 100.0 | 100.0 | +0.0 |" in text
    assert "| 2 | units | 2 | 75.0 | 50.0 | -25.0 |" in text  # per place: n counts the golds with that place
    assert "| * | 1 | exact match % | 100.0 | 0.0 | -100.0 |" in text
    assert breakdown_lines([]) == [] and breakdown_lines(None) == []
