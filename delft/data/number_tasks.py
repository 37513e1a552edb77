"""An offline digit benchmark for decoder LMs in the manner of the Number Cookbook (NUPA, ICLR 2025): integer and
decimal tasks binned by length, each problem a prompt and its one exact answer.

Tasks (``kind/task``): ``integer/`` add, subtract, multiply, max, digit, length, round and ``decimal/`` add,
subtract, multiply, max, digit, round. Comparison is asked as ``max`` (the larger of two different numbers), so
every answer is a number the answer scorer reads. A problem in length bin L has operands of exactly L digits: an
integer of L digits (no leading zero, ``0`` counts as one digit); a decimal of L >= 2 digits, ceil(L/2) before
the point and floor(L/2) after it, the last one not 0 (so ``0.5`` has length 2 and no operand ends in a zero
that the answer would drop). ``digit`` asks for the digit at one of the number's own places (``hundreds``,
``tenths``, ``10^9``), ``round`` for the nearest multiple of 10^k of an integer or k decimal places of a
decimal, never at an exact tie (no rounding convention is needed); ``subtract`` takes the larger operand first,
so every answer is >= 0. Answers are written plainly (no separators, no trailing fraction zeros).

Draws are deterministic: each (task, length) bin has its own generator seeded by the draw's seed, the task and the
length (so adding a task or a length changes no other bin), and a draw never repeats a prompt. ``exclude`` keeps
prompts out by content, so an eval draw can be kept apart from a training draw even where their seeds would
overlap: ``draw(100, "eval", exclude=prompts(train))``. The shortest bins hold few problems (one-digit
``integer/length`` has 10, one-digit ``integer/subtract`` 55): a bin that cannot give ``per_bin`` distinct
problems outside ``exclude`` is refused rather than silently cut short. The three scores are NUPA's: exact
match, digit match (the share of digits right, aligned by place) and the length difference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from decimal import ROUND_HALF_DOWN, ROUND_HALF_UP, Decimal
from typing import Callable, Collection, Iterable, Optional, Sequence

from delft.errors import UserError
from delft.numbers.answers import canonical, parse_number
from delft.numbers.digits import digits_by_place, exact_context, place_name

KINDS = ("integer", "decimal")


MAX_LENGTH = 20


LENGTHS = tuple(range(1, MAX_LENGTH + 1))


# Attempts a bin may spend per problem before it is called exhausted (a short bin, or one the exclusions empty).
_ATTEMPTS_PER_PROBLEM, _ATTEMPTS_SPARE = 30, 300


@dataclass(frozen=True)
class Problem:
    """One problem: its task (``integer/add``), its length bin, the prompt and the one exact answer."""

    task: str
    length: int
    prompt: str
    answer: str

    @property
    def kind(self) -> str:
        return self.task.split("/")[0]


def _integer(rng: random.Random, length: int) -> str:
    return str(rng.randrange(10) if length == 1 else rng.randrange(10 ** (length - 1), 10 ** length))


def _decimal(rng: random.Random, length: int) -> str:
    whole, fraction = (length + 1) // 2, length // 2
    digits = "".join(rng.choice("0123456789") for _ in range(fraction - 1)) + rng.choice("123456789")
    return f"{_integer(rng, whole)}.{digits}"


def _operand(rng: random.Random, kind: str, length: int) -> str:
    return _integer(rng, length) if kind == "integer" else _decimal(rng, length)


def _exact(text: str) -> str:
    """A computed value written plainly, within a precision that holds a 40-digit product."""
    with exact_context():
        return canonical(Decimal(text))


def _arithmetic(symbol: str, op: Callable[[Decimal, Decimal], Decimal]) -> Callable:
    def make(rng: random.Random, kind: str, length: int) -> Optional[tuple[str, str]]:
        a, b = _operand(rng, kind, length), _operand(rng, kind, length)
        if symbol == "-" and Decimal(a) < Decimal(b):
            a, b = b, a
        with exact_context():
            value = op(Decimal(a), Decimal(b))
            return f"What is {a} {symbol} {b}?", canonical(value)
    return make


def _max(rng: random.Random, kind: str, length: int) -> Optional[tuple[str, str]]:
    a, b = _operand(rng, kind, length), _operand(rng, kind, length)
    if Decimal(a) == Decimal(b):
        return None
    return f"Which is larger, {a} or {b}?", _exact(max(a, b, key=Decimal))


def _digit(rng: random.Random, kind: str, length: int) -> Optional[tuple[str, str]]:
    n = _operand(rng, kind, length)
    place, digit = rng.choice(sorted(digits_by_place(n).items()))
    return f"What is the digit in the {place_name(place)} place of {n}?", digit


def _length(rng: random.Random, kind: str, length: int) -> Optional[tuple[str, str]]:
    n = _operand(rng, kind, length)
    return f"How many digits does {n} have?", str(len(n))


def _round(rng: random.Random, kind: str, length: int) -> Optional[tuple[str, str]]:
    n = _operand(rng, kind, length)
    if kind == "integer":
        k = rng.randint(1, max(1, length - 1))
        step, prompt = Decimal(10) ** k, f"Round {n} to the nearest multiple of {10 ** k}."
    else:
        k = rng.randint(0, len(n.split(".")[1]) - 1)
        step, prompt = Decimal(10) ** -k, f"Round {n} to {k} decimal places."
    with exact_context():
        up = (Decimal(n) / step).quantize(Decimal(1), rounding=ROUND_HALF_UP) * step
        down = (Decimal(n) / step).quantize(Decimal(1), rounding=ROUND_HALF_DOWN) * step
        return None if up != down else (prompt, canonical(up))


_MAKERS: dict[str, Callable[[random.Random, str, int], Optional[tuple[str, str]]]] = {
    "add": _arithmetic("+", lambda a, b: a + b),
    "subtract": _arithmetic("-", lambda a, b: a - b),
    "multiply": _arithmetic("*", lambda a, b: a * b),
    "max": _max,
    "digit": _digit,
    "length": _length,
    "round": _round,
}


TASKS = tuple(f"integer/{t}" for t in _MAKERS) + tuple(f"decimal/{t}" for t in _MAKERS if t != "length")


def task_lengths(task: str, lengths: Iterable[int] = LENGTHS) -> list[int]:
    """The bins of ``lengths`` a task has: a decimal needs two digits, one each side of the point."""
    low = 2 if task.startswith("decimal/") else 1
    return [n for n in lengths if low <= n <= MAX_LENGTH]


def _check(tasks: Sequence[str], lengths: Iterable[int], per_bin: int) -> None:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"no number task {', '.join(map(repr, unknown))}", "number tasks",
                        f"Use some of: {', '.join(TASKS)}.")
    bad = [n for n in lengths if not 1 <= n <= MAX_LENGTH]
    if bad:
        raise UserError(f"length bins {bad} are outside 1..{MAX_LENGTH}", "number tasks",
                        f"Use lengths from 1 to {MAX_LENGTH} digits.")
    if per_bin < 1:
        raise UserError(f"{per_bin} problems per bin were asked for", "number tasks", "Ask for at least 1.")


def _bin(task: str, length: int, per_bin: int, seed: int | str, exclude: Collection[str]) -> list[Problem]:
    kind, name = task.split("/")
    rng = random.Random(f"{seed}/{task}/{length}")
    out: list[Problem] = []
    seen: set[str] = set()
    for _ in range(per_bin * _ATTEMPTS_PER_PROBLEM + _ATTEMPTS_SPARE):
        made = _MAKERS[name](rng, kind, length)
        if made is None or made[0] in seen or made[0] in exclude:
            continue
        seen.add(made[0])
        out.append(Problem(task, length, *made))
        if len(out) == per_bin:
            return out
    raise UserError(f"{task} at length {length} gave only {len(out)} distinct problems of the {per_bin} asked for"
                    " (short numbers have few problems, and excluded prompts remove more)", "number tasks",
                    "Ask for fewer problems per bin, or leave the shortest lengths out.")


def draw(per_bin: int, seed: int | str, tasks: Sequence[str] = TASKS, lengths: Iterable[int] = LENGTHS,
         exclude: Collection[str] = frozenset()) -> list[Problem]:
    """``per_bin`` distinct problems for every task and length bin (task by task, shortest first), none of whose
    prompts is in ``exclude``; the same arguments give the same problems."""
    lengths = list(lengths)
    _check(tasks, lengths, per_bin)
    return [p for task in tasks for n in task_lengths(task, lengths) for p in _bin(task, n, per_bin, seed, exclude)]


def prompts(problems: Iterable[Problem]) -> frozenset[str]:
    """The prompts of a draw, to exclude from another: ``draw(n, "eval", exclude=prompts(train))``."""
    return frozenset(p.prompt for p in problems)


def _value(text: Optional[str]) -> Optional[Decimal]:
    return parse_number(text) if text is not None else None


def exact_match(pred: Optional[str], gold: str) -> bool:
    """Is the predicted answer text the gold number (numerically: ``"1,234"`` and ``"1234.0"`` are 1234)?"""
    value = _value(pred)
    return value is not None and value == parse_number(gold)


def digit_match(pred: Optional[str], gold: str) -> float:
    """The share of digit places, over the gold's and the prediction's together, where both have the same digit
    (aligned by place, signs dropped): a digit too many or too few counts as wrong. No number scores 0."""
    value = _value(pred)
    if value is None:
        return 0.0
    want = digits_by_place(_exact(gold))
    got = digits_by_place(canonical(value))
    places = set(want) | set(got)
    return sum(want.get(p) == got.get(p) for p in places) / len(places)


def length_difference(pred: Optional[str], gold: str) -> Optional[int]:
    """Digits in the predicted number minus digits in the gold (plain forms, signs dropped); None: no number."""
    value = _value(pred)
    if value is None:
        return None
    return len(digits_by_place(canonical(value))) - len(digits_by_place(_exact(gold)))
