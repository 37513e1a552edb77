"""Digits, numbers and places: the one shared piece used by the losses, eval and inspect.

A *place* is an int: r >= 1 for the r-th integer digit from the right (1 = units, 2 = tens, ...),
-i for the i-th digit after the decimal point (-1 = tenths, -2 = hundredths, ...).

Run rules (the DEL reference's, docs/losses.md): consecutive characters in '0'..'9' and '.' form a run; the
first '.' at index > 0 is the decimal point; a run that starts with '.' has no point (every entry counts as
integer-like). Places count character positions, so in "1.2.3" the '3' is place -3. Dots are never scored.
Unlike the reference, runs are found per sequence and an ignored label (-100) ends a run. Runs and places
are properties of the characters, not of the tokens: ``token_places`` finds them across multi-digit tokens.

Thousands separators join a number, as the answer scorer reads it (delft.numbers.answers): in "1,234" the '1' is
the thousands digit for the losses, eval and inspect alike. A ',' is a separator when the digits before it are
a whole group of 1-3 (not after a '.') and every ',' of the chain is followed by exactly three digits, the last
group not followed by another digit: "1,000,000" and "$1,234.50" join; "3,4" in a list and "12,3456" do not.
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal
from typing import Optional, Sequence

DIGITS = "0123456789"


# Any decimal digit but ASCII's: Arabic-Indic, Devanagari, full-width, ... (what Python's \d reads besides 0-9).
_OTHER_DIGIT = re.compile(r"(?![0-9])\d")


def ascii_digits(text: str) -> str:
    """``text`` with every Unicode decimal digit written as its ASCII digit ("٤٢" and "４２" -> "42"), one character
    for one, so offsets stay. The answer scorer and the number formats read digits after it: one notion of a digit
    for the scorer, the formats and the losses (which score ASCII digit tokens only)."""
    if text.isascii():
        return text
    return _OTHER_DIGIT.sub(lambda m: str(unicodedata.decimal(m.group())), text)


RUN_CHARS = DIGITS + "."


FRACTION_DECAY = 1.02  # DEL's fraction weights: 1.02 ** -(i + 1)


# Significant digits for exact arithmetic on numbers: Decimal's default 28 would round a sum of two 30-digit
# operands (and a 30-digit answer's rounding to an integer raises), so long numbers use this context instead.
DECIMAL_PRECISION = 100


def number_runs(chars: Sequence[Optional[str]]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of '0'..'9' and '.' (None and other characters end a run)."""
    runs, start = [], 0
    while start < len(chars):
        if chars[start] is None or chars[start] not in RUN_CHARS:
            start += 1
            continue
        end = start
        while end < len(chars) and chars[end] is not None and chars[end] in RUN_CHARS:
            end += 1
        runs.append((start, end))
        start = end
    return runs


def _is_digit(c: Optional[str]) -> bool:
    return c is not None and c in DIGITS


def thousands_separators(chars: Sequence[Optional[str]]) -> set[int]:
    """Positions of the ',' that are thousands separators (module docstring): they join a number's run."""
    out: set[int] = set()
    n, i = len(chars), 0
    while i < n:
        if not _is_digit(chars[i]) or (i > 0 and (_is_digit(chars[i - 1]) or chars[i - 1] == ".")):
            i += 1
            continue
        j = i
        while j < n and _is_digit(chars[j]):
            j += 1
        commas, k = [], j
        if j - i <= 3:
            while k + 3 < n and chars[k] == "," and all(_is_digit(c) for c in chars[k + 1:k + 4]):
                commas.append(k)
                k += 4
            while commas and k < n and _is_digit(chars[k]):  # the last group runs on: not a separated number
                k = commas.pop()
        out.update(commas)
        i = max(k, j)
    return out


def run_places(chars: Sequence[Optional[str]]) -> list[Optional[int]]:
    """Place of every position (None for non-digits, dots, thousands separators and anything outside a number).

    ``chars`` holds one character (or None) per position; None and any character outside '0'..'9' and '.'
    end a run, except a thousands separator. Example: list("x12.57.") -> [None, 2, 1, None, -1, -2, None];
    list("1,234") -> [4, None, 3, 2, 1].
    """
    seps = thousands_separators(chars)
    if seps:  # places of the number without its separators, put back at the characters' positions
        keep = [i for i in range(len(chars)) if i not in seps]
        out: list[Optional[int]] = [None] * len(chars)
        for i, place in zip(keep, run_places([chars[i] for i in keep])):
            out[i] = place
        return out
    places: list[Optional[int]] = [None] * len(chars)
    for start, end in number_runs(chars):
        run = chars[start:end]
        point = next((j for j, c in enumerate(run) if c == "."), None)
        if point == 0:
            point = None  # ".5": no decimal point, integer-like
        for j, c in enumerate(run):
            if c == ".":
                continue
            if point is None:
                places[start + j] = len(run) - j
            else:
                places[start + j] = point - j if j < point else -(j - point)
    return places


def token_places(texts: Sequence[Optional[str]]) -> list[tuple[Optional[int], ...]]:
    """Places of every character of every token, runs found across tokens (the character-level view).

    ``texts[t]`` is token t's text, or None for a token that is no part of a number (an ignored label, a
    word); None and empty texts end a run. So "12345" gets the same places as 1|2|3|4|5 or 123|45:
    ["123", "45"] -> [(5, 4, 3), (2, 1)]; ["3", ".", "14"] -> [(1,), (None,), (-1, -2)]; None -> ().
    """
    chars: list[Optional[str]] = []
    owners: list[int] = []
    for t, text in enumerate(texts):
        chars.extend(text if text else [None])
        owners.extend([t] * (len(text) if text else 1))
    out: list[list[Optional[int]]] = [[] for _ in texts]
    for t, c, place in zip(owners, chars, run_places(chars)):
        if c is not None:
            out[t].append(place)
    return [tuple(p) for p in out]


PLACE_WEIGHTS = ("reference", "capped", "uniform")  # loss.place_weights


DEFAULT_PLACE_WEIGHT_CAP = 10.0


def place_weight(place: int, mode: str = "reference", cap: float = DEFAULT_PLACE_WEIGHT_CAP) -> float:
    """DEL's weight of a digit at ``place``.

    'reference': 2 * r for the r-th integer digit, 1.02 ** -(i + 1) for the i-th fraction digit (grows without
    bound: a 20-digit integer's leading digit weighs 40); 'capped': the same with integer weights at most
    ``cap``; 'uniform': 1 everywhere.
    """
    if mode == "uniform":
        return 1.0
    if mode not in PLACE_WEIGHTS:
        raise ValueError(f"place weights must be one of {PLACE_WEIGHTS}, not {mode!r}")
    if place > 0:
        return 2.0 * place if mode == "reference" else min(2.0 * place, cap)
    return FRACTION_DECAY ** -(-place + 1)


_INTEGER_NAMES = ["units", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands", "millions"]


_FRACTION_NAMES = ["tenths", "hundredths", "thousandths", "ten-thousandths"]


def place_name(place: int) -> str:
    if place > 0:
        return _INTEGER_NAMES[place - 1] if place <= len(_INTEGER_NAMES) else f"10^{place - 1}"
    i = -place
    return _FRACTION_NAMES[i - 1] if i <= len(_FRACTION_NAMES) else f"10^-{i}"


def exact_context():
    """A decimal context (``with exact_context(): ...``) precise enough for the longest numbers delft handles."""
    from decimal import localcontext

    return localcontext(prec=DECIMAL_PRECISION)


def digits_by_place(value: Decimal | str | int | float) -> dict[int, str]:
    """Every digit of a number keyed by place, sign dropped: "-12.5" -> {2: '1', 1: '2', -1: '5'}."""
    text = format(Decimal(str(value)).copy_abs(), "f") if not isinstance(value, str) else value.lstrip("+-")
    integer, _, fraction = text.partition(".")
    integer = integer.lstrip("0") or "0"
    out = {len(integer) - j: c for j, c in enumerate(integer)}
    out.update({-(i + 1): c for i, c in enumerate(fraction)})
    return out

