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

import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from decimal import ROUND_HALF_DOWN, ROUND_HALF_UP, Decimal
from typing import Callable, Collection, Iterable, Mapping, Optional, Sequence

from delft.errors import UserError
from delft.numbers.answers import canonical, parse_number
from delft.numbers.digits import digits_by_place, exact_context, place_name

KINDS = ("integer", "decimal")


MAX_LENGTH = 20


LENGTHS = tuple(range(1, MAX_LENGTH + 1))


# Attempts a bin may spend per problem before it is called exhausted; a bin up to _COLLECTED_BIN problems may
# also spend what collecting all of it takes (bins are checked against their sizes before anything is drawn).
_ATTEMPTS_PER_PROBLEM, _ATTEMPTS_SPARE, _COLLECTED_BIN = 30, 300, 100_000


# The most problems per bin: a draw holds per_bin x bins problems in memory (up to 260 bins), made one by one.
MAX_PER_BIN = 10_000


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


def _operands(kind: str, length: int) -> int:
    """How many operands of ``length`` digits a kind has (as ``_operand`` writes them)."""
    if kind == "integer":
        return 10 if length == 1 else 9 * 10 ** (length - 1)
    whole, fraction = (length + 1) // 2, length // 2
    return _operands("integer", whole) * 10 ** (fraction - 1) * 9  # the last fraction digit is not 0


def _ties(kind: str, length: int) -> int:
    """How many (number, rounding place) pairs of a bin are exact ties, which ``round`` never draws."""
    if kind == "integer":
        # the last k digits 50..0 and L - k free leading digits, the first not 0 (a one-digit 5 ties at 10)
        return 1 if length == 1 else sum(9 * 10 ** (length - k - 1) for k in range(1, length))
    whole, fraction = (length + 1) // 2, length // 2
    return _operands("integer", whole) * 10 ** (fraction - 1)  # the last place kept, the dropped digit a lone 5


def bin_size(task: str, length: int) -> int:
    """How many distinct problems (prompts) the bin of ``task`` at ``length`` digits holds: what a draw can give
    at most, worked out from how the bin's problems are made rather than by drawing them."""
    kind, name = task.split("/")
    n = _operands(kind, length)
    if name in ("add", "multiply"):
        return n * n
    if name == "subtract":
        return n * (n + 1) // 2  # the larger operand first, equal ones once
    if name == "max":
        return n * (n - 1)
    if name == "digit":
        return n * length  # every operand has exactly ``length`` digit places
    if name == "length":
        return n
    places = max(1, length - 1) if kind == "integer" else length // 2
    return n * places - _ties(kind, length)


def _check(tasks: Sequence[str], lengths: Iterable[int], per_bin: int) -> None:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"no number task {', '.join(map(repr, unknown))}", "number tasks",
                        f"Use some of: {', '.join(TASKS)}.")
    bad = [n for n in lengths if not 1 <= n <= MAX_LENGTH]
    if bad:
        raise UserError(f"length bins {bad} are outside 1..{MAX_LENGTH}", "number tasks",
                        f"Use lengths from 1 to {MAX_LENGTH} digits.")
    if not 1 <= per_bin <= MAX_PER_BIN:
        raise UserError(f"{per_bin} problems per bin were asked for", "number tasks",
                        f"Ask for 1 to {MAX_PER_BIN:,} per bin.")


def short_bins(per_bin: int, tasks: Sequence[str], lengths: Iterable[int],
               taken: Optional[Mapping[tuple[str, int], int]] = None) -> list[str]:
    """The bins of a draw that cannot give ``per_bin`` distinct problems once the ``taken`` count of each bin's
    problems (excluded ones) is set aside, each described with its size; worked out, nothing drawn."""
    taken = taken or {}
    out = []
    for task in tasks:
        for n in task_lengths(task, lengths):
            size, gone = bin_size(task, n), taken.get((task, n), 0)
            if per_bin > size - gone:
                held = f"{size:,} distinct problems" + (f", {gone:,} of them excluded" if gone else "")
                out.append(f"{task} at length {n} ({held})")
    return out


def bins_text(short: Sequence[str]) -> str:
    """``short_bins``' answer in a sentence: the first four, and how many more."""
    return "; ".join(short[:4]) + (f"; and {len(short) - 4} more" if len(short) > 4 else "")


def refuse_short_bins(short: Sequence[str], per_bin: int, where: str = "number tasks") -> None:
    """The UserError for ``short_bins``' answer, if it named any."""
    if short:
        raise UserError(f"{per_bin:,} problems per bin were asked for, and some bins hold fewer distinct problems: "
                        f"{bins_text(short)}. Short numbers have few problems, and an eval draw leaves out the training "
                        "problems (nothing was drawn)",
                        where, "Ask for fewer problems per bin (per_bin), or leave the shortest lengths out "
                        "(min_length: 2 or more).")


def bin_counts(problems: Iterable[Problem]) -> dict[tuple[str, int], int]:
    """How many of ``problems`` each (task, length) bin holds."""
    return dict(Counter((p.task, p.length) for p in problems))


def drawn_counts(per_bin: int, tasks: Sequence[str], lengths: Iterable[int],
                 limit: Optional[int] = None) -> dict[tuple[str, int], int]:
    """How many problems each bin gives to ``draw(per_bin, ..., tasks, lengths)[:limit]`` (bins in draw order)."""
    lengths, left, out = list(lengths), limit if limit is not None else float("inf"), {}
    for task in tasks:
        for n in task_lengths(task, lengths):
            out[(task, n)] = int(min(per_bin, left))
            left -= out[(task, n)]
    return out


_NUMBER = r"(0|[1-9]\d*)(?:\.(\d*[1-9]))?"
_PROMPTS = {name: re.compile(pattern) for name, pattern in {
    "arithmetic": rf"What is {_NUMBER} ([-+*]) {_NUMBER}\?",
    "max": rf"Which is larger, {_NUMBER} or {_NUMBER}\?",
    "digit": rf"What is the digit in the (\S+) place of {_NUMBER}\?",
    "length": rf"How many digits does {_NUMBER} have\?",
    "round": rf"Round {_NUMBER} to (?:the nearest multiple of (10+)|(\d+) decimal places)\.",
}.items()}
_SYMBOLS = {"+": "add", "-": "subtract", "*": "multiply"}


def _shape(whole: str, fraction: Optional[str]) -> Optional[tuple[str, int]]:
    """(kind, length) of an operand as ``_operand`` writes it, or None where it writes no such number."""
    if fraction is None:
        return "integer", len(whole)
    length = len(whole) + len(fraction)
    ok = len(whole) == (length + 1) // 2 and len(fraction) == length // 2
    return ("decimal", length) if ok else None


def _bin_of(prompt: str) -> Optional[tuple[str, int]]:
    """The (task, length) bin whose generator writes ``prompt``, or None where no bin does."""
    for name, pattern in _PROMPTS.items():
        m = pattern.fullmatch(prompt)
        if m:
            return _matched_bin(name, m.groups())
    return None


def _matched_bin(name: str, g: tuple) -> Optional[tuple[str, int]]:
    shape = _shape(g[0], g[1]) if name != "digit" else _shape(g[1], g[2])
    if shape is None:
        return None
    kind, length = shape
    number = g[0] + (f".{g[1]}" if g[1] else "")
    if name in ("arithmetic", "max"):
        other = g[3:5] if name == "arithmetic" else g[2:4]
        second = other[0] + (f".{other[1]}" if other[1] else "")
        if _shape(*other) != shape:
            return None
        if name == "max":
            return (f"{kind}/max", length) if Decimal(number) != Decimal(second) else None
        task = _SYMBOLS[g[2]]
        ok = task != "subtract" or Decimal(number) >= Decimal(second)
        return (f"{kind}/{task}", length) if ok else None
    if name == "digit":
        places = {place_name(p) for p in digits_by_place(g[1] + (f".{g[2]}" if g[2] else ""))}
        return (f"{kind}/digit", length) if g[0] in places else None
    if name == "length":
        return ("integer/length", length) if kind == "integer" else None
    return _round_bin(kind, length, number, g[2], g[3])


def _round_bin(kind: str, length: int, number: str, power: Optional[str],
               places: Optional[str]) -> Optional[tuple[str, int]]:
    if kind == "integer":
        if power is None or not 1 <= len(power) - 1 <= max(1, length - 1):
            return None
        step = Decimal(power)
    else:
        if places is None or str(int(places)) != places or not 0 <= int(places) < length // 2:
            return None
        step = Decimal(10) ** -int(places)
    with exact_context():
        up = (Decimal(number) / step).quantize(Decimal(1), rounding=ROUND_HALF_UP)
        down = (Decimal(number) / step).quantize(Decimal(1), rounding=ROUND_HALF_DOWN)
    return (f"{kind}/round", length) if up == down else None


def excluded_counts(exclude: Collection[str]) -> dict[tuple[str, int], int]:
    """How many of the prompts in ``exclude`` each bin's generator writes (the rest are no bin's)."""
    return dict(Counter(b for b in map(_bin_of, exclude) if b is not None))


def _bin(task: str, length: int, per_bin: int, seed: int | str, exclude: Collection[str]) -> list[Problem]:
    kind, name = task.split("/")
    rng = random.Random(f"{seed}/{task}/{length}")
    out: list[Problem] = []
    seen: set[str] = set()
    for _ in range(_attempts(per_bin, bin_size(task, length))):
        made = _MAKERS[name](rng, kind, length)
        if made is None or made[0] in seen or made[0] in exclude:
            continue
        seen.add(made[0])
        out.append(Problem(task, length, *made))
        if len(out) == per_bin:
            return out
    raise UserError(f"{task} at length {length} gave only {len(out)} distinct problems of the {per_bin} asked for"
                    " (it holds enough, but drawing at random found no more within its attempts)", "number tasks",
                    "Ask for fewer problems per bin, or leave the shortest lengths out.")


def _attempts(per_bin: int, size: int) -> int:
    """Draws a bin may spend: enough per problem, and in a small bin enough to collect nearly all of it (a draw
    that takes most of a bin, or what the exclusions leave of it, finds its last problems rarely)."""
    collect = 3 * size * (math.log(size) + 1) if size <= _COLLECTED_BIN else 0
    return per_bin * _ATTEMPTS_PER_PROBLEM + _ATTEMPTS_SPARE + int(collect)


def draw(per_bin: int, seed: int | str, tasks: Sequence[str] = TASKS, lengths: Iterable[int] = LENGTHS,
         exclude: Collection[str] = frozenset()) -> list[Problem]:
    """``per_bin`` distinct problems for every task and length bin (task by task, shortest first), none of whose
    prompts is in ``exclude``; the same arguments give the same problems."""
    lengths = list(lengths)
    _check(tasks, lengths, per_bin)
    refuse_short_bins(short_bins(per_bin, tasks, lengths, excluded_counts(exclude)), per_bin)
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
