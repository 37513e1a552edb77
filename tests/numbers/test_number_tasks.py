"""The number-task benchmark (delft/data/number_tasks.py): every answer against Python's own arithmetic (ints and
Fractions, worked out here from the prompt's text), the length bins, reproducible seeds, eval draws kept apart
from training draws by content, and the three scores."""

from __future__ import annotations

import math
import random
import re
import time
from fractions import Fraction

import pytest

from delft.data.number_tasks import (
    _MAKERS, LENGTHS, MAX_PER_BIN, TASKS, Problem, _bin_of, bin_counts, bin_size, digit_match, draw, drawn_counts,
    exact_match, excluded_counts, length_difference, prompts, task_lengths,
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


def test_a_bin_the_exclusions_empty_is_refused_before_drawing():
    train = draw(10, seed=1, tasks=["integer/length"], lengths=[1])  # "How many digits does 7 have?": 10 prompts
    with pytest.raises(UserError, match=r"integer/length at length 1 \(10 distinct problems, 10 of them excluded\)"):
        draw(1, seed=2, tasks=["integer/length"], lengths=[1], exclude=prompts(train))


def _collected(task: str, length: int, attempts: int) -> set[str]:
    """Every distinct prompt the bin's generator writes in ``attempts`` draws (a small bin: all of them)."""
    kind, name = task.split("/")
    rng = random.Random(f"collect/{task}/{length}")
    made = (_MAKERS[name](rng, kind, length) for _ in range(attempts))
    return {m[0] for m in made if m is not None}


_SIZED = [(t, n) for t in TASKS for n in task_lengths(t, [1, 2])] + [
    ("integer/round", 3), ("integer/round", 4), ("decimal/round", 3), ("decimal/round", 4)]


@pytest.mark.parametrize("task,length", [pytest.param(t, n, marks=[pytest.mark.slow] if bin_size(t, n) > 3000 else [])
                                         for t, n in _SIZED])
def test_a_bins_size_is_every_problem_its_generator_writes(task, length):
    size = bin_size(task, length)
    # ~15 x size draws collect every problem of a bin this small (the coupon collector needs size x ln size)
    found = _collected(task, length, 15 * size + 200)
    assert len(found) == size
    assert {_bin_of(p) for p in found} == {(task, length)}  # the classifier puts every prompt in its own bin


def test_a_bin_of_every_problem_is_found_from_its_prompt_and_other_prompts_are_no_bins():
    problems = draw(3, seed=5, lengths=range(2, 21)) + draw(3, seed=5, lengths=[1])
    assert all(_bin_of(p.prompt) == (p.task, p.length) for p in problems)
    not_drawn = ["What is 05 + 12?", "What is 12 + 345?", "What is 1 - 5?", "Which is larger, 3 or 3?",
                 "Round 15 to the nearest multiple of 10.", "Round 0.5 to 0 decimal places.",  # ties
                 "Round 0.15 to 1 decimal places.", "What is 1.20 + 3.45?", "How many digits does 7.5 have?",
                 "What is the digit in the tens place of 7?", "Round 123 to the nearest multiple of 1000."]
    assert [_bin_of(p) for p in not_drawn] == [None] * len(not_drawn)


def test_an_impossible_bin_is_refused_from_its_size_without_drawing(monkeypatch):
    assert len(draw(9, seed=0, tasks=["integer/round"], lengths=[1])) == 9  # a bin can be drawn whole
    drawn = []
    monkeypatch.setitem(_MAKERS, "round", lambda *a: drawn.append(a))  # counts draws; none may happen
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"integer/round at length 1 \(9 distinct problems\)"):
        draw(MAX_PER_BIN, seed=0, tasks=["integer/round"], lengths=[1, 2])
    assert drawn == [] and time.perf_counter() - start < 5  # the old draw spent minutes before refusing
    with pytest.raises(UserError, match="10 problems per bin"):
        draw(10, seed=0)  # every task at lengths 1..20: the one-digit round bin holds 9
    with pytest.raises(UserError, match="Ask for 1 to 10,000"):
        draw(MAX_PER_BIN + 1, seed=0, tasks=["integer/add"], lengths=[20])
    assert drawn == []


def test_a_draw_that_takes_most_of_what_the_exclusions_leave_still_draws():
    train = draw(8000, seed=1, tasks=["decimal/add"], lengths=[2])  # of 8,100
    rest = draw(100, seed=2, tasks=["decimal/add"], lengths=[2], exclude=prompts(train))
    assert len(prompts(rest)) == 100 and not prompts(rest) & prompts(train)


def test_drawn_counts_are_the_draws_own():
    tasks, lengths = ["integer/add", "decimal/max"], range(1, 5)
    problems = draw(7, seed=3, tasks=tasks, lengths=lengths)[:25]
    assert drawn_counts(7, tasks, lengths, 25) == {**{b: 0 for b in drawn_counts(7, tasks, lengths)},
                                                    **bin_counts(problems)}
    assert excluded_counts(prompts(problems)) == bin_counts(problems)


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
