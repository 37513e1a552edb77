"""The number-task benchmark (delft/data/number_tasks.py): every answer against Python's own arithmetic (ints and
Fractions, worked out here from the prompt's text), the length bins, reproducible seeds, eval draws kept apart
from training draws by content, and the three scores."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest

from delft.data.number_tasks import (
    LENGTHS, TASKS, Problem, digit_match, draw, exact_match, length_difference, prompts, task_lengths,
)
from delft.errors import UserError

PER_BIN = 6


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    return draw(PER_BIN, seed=7)


_INTEGER_PLACES = ["units", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands", "millions"]
_FRACTION_PLACES = ["tenths", "hundredths", "thousandths", "ten-thousandths"]


def _place(name: str) -> int:
    if name in _INTEGER_PLACES:
        return _INTEGER_PLACES.index(name) + 1
    if name in _FRACTION_PLACES:
        return -(_FRACTION_PLACES.index(name) + 1)
    power = int(name.removeprefix("10^"))  # "10^9": the digit worth 10^9, "10^-5": the fifth after the point
    return power + 1 if power >= 0 else power


def _digit_at(number: str, place: int) -> str:
    whole, _, fraction = number.partition(".")
    return whole[-place] if place > 0 else fraction[-place - 1]


def _nearest(x: Fraction) -> int:
    assert x - math.floor(x) != Fraction(1, 2), "a tie has no one answer"
    return math.floor(x + Fraction(1, 2))


def _expected(prompt: str) -> Fraction:
    """The answer, worked out from the prompt alone."""
    if m := re.fullmatch(r"What is (\S+) ([-+*]) (\S+)\?", prompt):
        a, b = Fraction(m.group(1)), Fraction(m.group(3))
        return {"+": a + b, "-": a - b, "*": a * b}[m.group(2)]
    if m := re.fullmatch(r"Which is larger, (\S+) or (\S+)\?", prompt):
        assert Fraction(m.group(1)) != Fraction(m.group(2))
        return max(Fraction(m.group(1)), Fraction(m.group(2)))
    if m := re.fullmatch(r"What is the digit in the (\S+) place of (\S+)\?", prompt):
        return Fraction(_digit_at(m.group(2), _place(m.group(1))))
    if m := re.fullmatch(r"How many digits does (\d+) have\?", prompt):
        return Fraction(len(m.group(1)))
    if m := re.fullmatch(r"Round (\d+) to the nearest multiple of (\d+)\.", prompt):
        step = int(m.group(2))
        return Fraction(_nearest(Fraction(int(m.group(1)), step)) * step)
    if m := re.fullmatch(r"Round (\S+) to (\d+) decimal places\.", prompt):
        step = Fraction(1, 10 ** int(m.group(2)))
        return _nearest(Fraction(m.group(1)) / step) * step
    raise AssertionError(f"no oracle for {prompt!r}")


def _operands(prompt: str) -> list[str]:
    body = re.sub(r"^Round (\S+) to .*", r"\1", prompt)
    body = re.sub(r"the nearest multiple of \d+|\d+ decimal places|10\^-?\d+ place", "", body)
    return re.findall(r"\d+(?:\.\d+)?", body)


def test_every_answer_is_pythons_arithmetic(problems):
    for p in problems:
        assert Fraction(p.answer) == _expected(p.prompt), p
        assert re.fullmatch(r"-?\d+(\.\d*[1-9])?", p.answer), p  # plainly written: no separators, no trailing zeros


def test_subtraction_never_goes_below_zero(problems):
    assert all(not p.answer.startswith("-") for p in problems)


def test_every_task_and_bin_is_drawn(problems):
    bins = {(p.task, p.length) for p in problems}
    assert bins == {(t, n) for t in TASKS for n in task_lengths(t)}
    assert task_lengths("integer/add") == list(LENGTHS) and task_lengths("decimal/add") == list(range(2, 21))
    assert all(sum(q.task == p.task and q.length == p.length for q in problems) == PER_BIN for p in problems)
    assert {p.kind for p in problems} == {"integer", "decimal"}


def test_operands_have_the_bins_length(problems):
    for p in problems:
        for n in _operands(p.prompt):
            whole, _, fraction = n.partition(".")
            assert len(whole) + len(fraction) == p.length, p
            assert len(whole) == 1 or whole[0] != "0", p
            if p.kind == "decimal":
                assert len(whole) == (p.length + 1) // 2 and fraction[-1] != "0", p
            else:
                assert not fraction, p


def test_prompts_in_a_draw_are_distinct(problems):
    assert len(prompts(problems)) == len(problems)


def test_seeds_are_reproducible():
    a = draw(3, seed=11, lengths=[1, 5, 20])
    assert a == draw(3, seed=11, lengths=[1, 5, 20])
    assert a != draw(3, seed=12, lengths=[1, 5, 20])
    alone = draw(3, seed=11, tasks=["decimal/round"], lengths=[5])  # a bin does not depend on the others drawn
    assert alone == [p for p in a if p.task == "decimal/round" and p.length == 5]


def test_eval_draws_exclude_training_prompts():
    train = draw(20, seed="train", lengths=range(2, 9))
    for seed in ("eval", "train"):  # even the training seed gives disjoint problems once its prompts are excluded
        held_out = draw(20, seed=seed, lengths=range(2, 9), exclude=prompts(train))
        assert not prompts(held_out) & prompts(train)
        assert len(held_out) == len(train)


def test_a_bin_the_exclusions_empty_is_refused():
    train = draw(10, seed=1, tasks=["integer/length"], lengths=[1])  # "How many digits does 7 have?": 10 prompts
    with pytest.raises(UserError, match="integer/length at length 1 gave only 0 distinct problems"):
        draw(1, seed=2, tasks=["integer/length"], lengths=[1], exclude=prompts(train))


@pytest.mark.parametrize("kwargs,message", [
    (dict(tasks=["integer/divide"]), "no number task 'integer/divide'"),
    (dict(lengths=[0, 21]), "outside 1..20"),
    (dict(per_bin=0), "0 problems per bin"),
])
def test_bad_draws_are_refused(kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        draw(**{"per_bin": 1, "seed": 0, **kwargs})


def test_exact_match():
    assert exact_match("1234", "1234") and exact_match("1,234", "1234") and exact_match("1234.0", "1234")
    assert exact_match("0.50", "0.5")
    assert not exact_match("1235", "1234") and not exact_match(None, "1") and not exact_match("none", "1")


def test_digit_match_aligns_by_place():
    assert digit_match("1234", "1234") == 1.0
    assert digit_match("1244", "1234") == 0.75
    assert digit_match("234", "1234") == 0.75  # the thousands digit is missing, the rest align
    assert digit_match("51234", "1234") == 0.8  # a digit too many is wrong
    assert digit_match("12.35", "12.5") == 0.5  # places 2, 1, -1, -2: the 1 and 2 right
    assert digit_match("-7", "7") == 1.0  # signs dropped
    assert digit_match(None, "7") == 0.0 and digit_match("x", "7") == 0.0
    assert digit_match("0", "0") == 1.0


def test_length_difference():
    assert length_difference("12345", "123") == 2
    assert length_difference("1", "123") == -2
    assert length_difference("1.25", "12.5") == 0
    assert length_difference("1,000", "1000") == 0
    assert length_difference(None, "5") is None
