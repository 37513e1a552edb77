"""Answer extraction, scoring and metrics (delft.numbers.answers): pure Python, no model."""

from decimal import Decimal

import pytest

from delft.evaluation.metrics import bootstrap_ci, paired_difference, summarize
from delft.numbers.answers import (
    PLAIN_STOP_STRINGS,
    Extraction,
    canonical,
    cut_at_stop,
    exact_match,
    extract_answer,
    parse_number,
    place_correct,
    score,
    signed_log,
    tolerance_match,
)

D = Decimal

# text -> (expected value as text or None, expected rule)
CASES = [
    # GSM8K marker: first "####" wins, even after other numbers
    ("#### 1,234", "1234", "####"),
    ("48 / 2 = 24 apples, 24 + 48 = 72\n#### 72", "72", "####"),
    ("#### 72\n#### 5", "72", "####"),
    ("#### -12.50", "-12.5", "####"),
    ("#### $1,000.", "1000", "####"),
    ("The total is 9. ####  3/4", "0.75", "####"),
    ("#### none, it is 7", "7", "last_number"),  # a marker without a number falls through
    # \boxed: the last box; LaTeX through math-verify
    ("\\boxed{12.5}", "12.5", "boxed"),
    ("So $\\boxed{-7}$.", "-7", "boxed"),
    ("first \\boxed{1} then \\boxed{2}", "2", "boxed"),
    ("\\boxed{1{,}234}", "1234", "boxed"),
    ("\\boxed{\\$12.50}", "12.5", "boxed"),
    ("\\boxed{45\\%}", "45", "boxed"),
    ("\\boxed{12 \\text{ apples}}", "12", "boxed_latex"),  # math-verify drops the unit text
    ("\\boxed{\\frac{1}{2}}", "0.5", "boxed_latex"),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", "boxed_latex"),
    ("\\boxed{x} so 5", "5", "last_number"),  # a box without a number falls through
    # "the answer is"
    ("The answer is -3", "-3", "answer_is"),
    ("answer: $1,234.50", "1234.5", "answer_is"),
    ("Answer = 17.", "17", "answer_is"),
    ("The final answer is: **42**", "42", "answer_is"),
    ("I think the answer is 4, no, the answer is 5 (5 + 0 = 5)", "5", "answer_is"),
    ("The answer is $\\frac{1}{4}$.", "0.25", "answer_is"),
    ("To find the answer we add 3 and 4 to get 7", "7", "last_number"),  # "answer" alone is not the phrase
    # last number
    ("45%", "45", "last_number"),
    ("7.", "7", "last_number"),
    ("3/4", "0.75", "last_number"),
    ("-3/4", "-0.75", "last_number"),
    ("-0.5", "-0.5", "last_number"),
    (".5", "0.5", "last_number"),
    ("-.5", "-0.5", "last_number"),
    ("hmm...5", "5", "last_number"),  # an ellipsis is not a decimal point
    ("version 1.2.3", "1.2", "last_number"),  # the ".3" of a dotted run is not a number
    ("1 2 3", "3", "last_number"),
    ("12 + 30 = 42 dollars.", "42", "last_number"),
    ("1,234,567", "1234567", "last_number"),
    ("1.000", "1", "last_number"),
    ("It costs $-3", "-3", "last_number"),
    ("It costs -$3", "-3", "last_number"),
    ("\u22124 degrees", "-4", "last_number"),  # Unicode minus
    ("x=-3", "-3", "last_number"),
    ("5-3", "3", "last_number"),  # a minus after a digit is an operator
    ("- 3", "3", "last_number"),  # a detached minus is not a sign
    ("1,2345", "2345", "last_number"),  # not a thousands group
    ("1.5/2", "2", "last_number"),  # fractions are integer/integer only
    ("1/0", "0", "last_number"),  # zero denominator: not a fraction
    ("H2O has 3 atoms", "3", "last_number"),  # digits glued to a letter are not a number
    ("about 2 or 1.5e3", "2", "last_number"),  # scientific notation is skipped
    ("1e5", None, "none"),
    ("no number here", None, "none"),
    ("", None, "none"),
    # run-on continuations are cut at the first stop string
    ("The answer is 5.\n\nQuestion: What is 3 + 4? Answer: 7", "5", "answer_is"),
    ("42\n\nWhat is 2 + 2?\n4", "42", "last_number"),
    ("\n\n42", "42", "last_number"),  # leading blank lines are not a stop
    ("12 Question: what is 1 + 1? 2", "12", "last_number"),
]


@pytest.mark.parametrize("text,value,rule", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_extraction_table(text, value, rule):
    got = extract_answer(text)
    assert got.rule == rule
    assert got.canonical == value
    if value is not None:
        assert got.value == D(value)


def test_table_is_large_and_covers_every_rule():
    assert len(CASES) >= 40
    assert {r for _, _, r in CASES} == {"####", "boxed", "boxed_latex", "answer_is", "last_number", "none"}


def test_custom_stops_and_cut():
    assert cut_at_stop("7<|im_end|>8", ["<|im_end|>"]) == "7"
    assert extract_answer("7\n\n8", stops=[]).value == 8  # chat answers keep their paragraphs
    assert extract_answer("7\n\n8", stops=PLAIN_STOP_STRINGS).value == 7


@pytest.mark.parametrize("text,value", [
    ("-12.5", "-12.5"), ("18.0", "18"), ("1,234", "1234"), ("$5", "5"), ("45%", "45"), (" 7. ", "7"),
    ("3/4", "0.75"), ("1E+2", "100"), ("12 apples", None), ("nan", None), ("", None), (None, None)])
def test_parse_number(text, value):
    got = parse_number(text)
    assert (None if got is None else canonical(got)) == value


def test_canonical():
    assert canonical(D("1.500")) == "1.5"
    assert canonical(D("1E+2")) == "100"
    assert canonical(D("-0.0")) == "0"
    assert canonical(D("0.05")) == "0.05"


# ----------------------------------------------------------------------------------------------- scoring


def test_exact_match():
    assert exact_match(D("1.000"), D("1"))
    assert exact_match(D("0.75"), D("0.75"))
    assert not exact_match(D("-3"), D("3"))
    assert not exact_match(None, D("0"))


@pytest.mark.parametrize("pred,gold,ok", [
    ("12.4", "12", True), ("11.6", "12", True), ("12.6", "12", False), ("12.5", "12", True),  # half to even
    ("13.5", "12", False), ("11.5", "12", True), ("-12.4", "-12", True), ("12", "-12", False),
    ("100", "104", False),  # integer gold: no 4 % slack
    ("1.04", "1", True),  # rounds to 1
    ("2.6", "2.5", True), ("2.4", "2.5", True),  # exactly 4 % of 2.5 = 0.1: inclusive
    ("2.61", "2.5", False), ("2.39", "2.5", False),
    ("-2.6", "-2.5", True), ("2.5", "-2.5", False), ("0.5", "0.5", True)])
def test_tolerance_match(pred, gold, ok):
    assert tolerance_match(D(pred), D(gold)) is ok


def test_tolerance_no_number():
    assert tolerance_match(None, D("1")) is False


def test_place_correct():
    # gold 123: units, tens, hundreds
    assert place_correct(D("123"), D("123")) == {3: True, 2: True, 1: True}
    assert place_correct(D("128"), D("123")) == {3: True, 2: True, 1: False}
    assert place_correct(D("23"), D("123")) == {3: False, 2: True, 1: True}  # missing hundreds is wrong
    assert place_correct(D("1123"), D("123")) == {3: True, 2: True, 1: True}  # extra places are not scored
    assert place_correct(D("-123"), D("123")) == {3: True, 2: True, 1: True}  # digits ignore the sign
    assert place_correct(None, D("12")) == {2: False, 1: False}
    # fractions: tenths, hundredths; trailing zeros of the gold do not count as places
    assert place_correct(D("4.25"), D("4.2")) == {1: True, -1: True}
    assert place_correct(D("4.2"), D("4.25")) == {1: True, -1: True, -2: False}  # missing hundredths
    assert place_correct(D("4.3"), D("4.50")) == {1: True, -1: False}
    assert place_correct(D("0.5"), D("0.05")) == {1: True, -1: False, -2: False}


def _scored(pairs):
    return [score(Extraction(None if p is None else D(p), "none" if p is None else "last_number"), D(g))
            for p, g in pairs]


def test_summarize_by_hand():
    s = _scored([("12", "12"), ("13", "12"), (None, "5"), ("-1.5", "-1.25"), ("1000", "10")])
    m = summarize(s, resamples=200, seed=1)
    assert m["n"] == 5
    assert m["exact_match"] == pytest.approx(1 / 5)
    assert m["tolerance_match"] == pytest.approx(1 / 5)  # 13 != 12; 1.5 is 20 % off 1.25
    assert m["no_number_rate"] == pytest.approx(1 / 5)
    assert m["n_with_number"] == 4
    assert m["mae"] == pytest.approx((0 + 1 + 0.25 + 990) / 4)
    logs = [0, abs(signed_log(D(13)) - signed_log(D(12))), abs(signed_log(D("-1.5")) - signed_log(D("-1.25"))),
            abs(signed_log(D(1000)) - signed_log(D(10)))]
    assert m["log_mae"] == pytest.approx(sum(logs) / 4)
    pp = m["per_place"]
    # tens: 12 ok, 12 (13) ok, 5 has no tens, 10: 1000 has '0' at tens, gold '1' -> wrong
    assert pp["tens"] == {"place": 2, "accuracy": pytest.approx(2 / 3), "n": 3}
    # units: 12 ok, 13 wrong, none wrong, 1.25 vs 1.5 ok, 10 vs 1000 ok
    assert pp["units"]["accuracy"] == pytest.approx(3 / 5) and pp["units"]["n"] == 5
    assert pp["tenths"]["accuracy"] == pytest.approx(0.0) and pp["hundredths"]["accuracy"] == pytest.approx(0.0)
    assert list(pp) == ["tens", "units", "tenths", "hundredths"]
    assert m["digit_accuracy"] == pytest.approx((2 + 3 + 0 + 0) / (3 + 5 + 1 + 1))
    assert m["rules"]["none"] == 1 and m["rules"]["last_number"] == 4


def test_signed_log():
    assert signed_log(D(0)) == 0
    assert signed_log(D(9)) == pytest.approx(1.0)
    assert signed_log(D(-99)) == pytest.approx(-2.0)


def test_summarize_empty():
    m = summarize([], resamples=100)
    assert m["n"] == 0 and m["exact_match"] is None and m["exact_match_ci"] is None and m["mae"] is None


def test_bootstrap_ci():
    flags = [True] * 30 + [False] * 70
    a = bootstrap_ci(flags, resamples=500, seed=3)
    b = bootstrap_ci(flags, resamples=500, seed=3)
    c = bootstrap_ci(flags, resamples=500, seed=4)
    assert a == b  # deterministic with a seed
    assert a != c
    assert a[0] <= 0.3 <= a[1]
    assert 0.15 < a[0] < 0.3 < a[1] < 0.45  # about +-9 points for n=100
    assert bootstrap_ci([True] * 10, resamples=100) == (1.0, 1.0)
    assert bootstrap_ci([], resamples=100) is None
    assert bootstrap_ci(flags, resamples=0) is None


def test_summarize_ci_contains_point_estimate():
    s = _scored([("1", "1"), ("2", "1"), ("3", "3"), ("4", "5")] * 5)
    m = summarize(s, resamples=300, seed=0)
    lo, hi = m["exact_match_ci"]
    assert lo <= m["exact_match"] <= hi
    assert summarize(s, resamples=300, seed=0)["exact_match_ci"] == [lo, hi]


def test_paired_difference():
    a = [False] * 20
    b = [True] * 10 + [False] * 10
    d = paired_difference(a, b, resamples=300, seed=0)
    assert d["difference"] == pytest.approx(0.5)
    assert d["ci"][0] <= 0.5 <= d["ci"][1] and d["ci"][0] > 0
    assert paired_difference(a, a, resamples=100)["ci"] == [0.0, 0.0]


def test_long_numbers_score_exactly():
    # Past Decimal's default 28 digits: no rounding in canonical form, tolerance or places.
    gold = Decimal("123456789012345678901234567890")
    near = Decimal("123456789012345678901234567891")
    assert canonical(gold) == "123456789012345678901234567890"
    assert exact_match(gold, gold) and not exact_match(near, gold)
    assert tolerance_match(gold, gold) and not tolerance_match(near, gold)
    places = place_correct(near, gold)
    assert len(places) == 30 and not places[1] and all(places[p] for p in range(2, 31))


def test_tolerance_of_a_number_longer_than_the_decimal_precision():
    """A rambling model writes a 150-digit number: scored (wrong), not a decimal.InvalidOperation (it stopped a
    5-shot GSM8K eval of SmolLM2-135M)."""
    from decimal import Decimal

    from delft.numbers.answers import Extraction, score, tolerance_match

    huge = Decimal("1" * 150 + ".5")
    assert tolerance_match(huge, Decimal(5)) is False
    assert tolerance_match(huge, huge.to_integral_value(rounding="ROUND_HALF_EVEN")) is True
    s = score(Extraction(huge, "1" * 150 + ".5", "last_number"), Decimal(5))
    assert not s.exact and not s.tolerance and s.places == {1: False}  # units 1, not 5
