r"""How numbers are written in training text: natural or reversed digit order, with or without a digit-count prefix.

Published fine-tuning gains come from the way numbers are written in the targets: least significant digit first
(RevOrder, arXiv 2402.03822; "Reverse That Number!", arXiv 2403.05845), so each digit of a sum is written after
the digits its carry depends on; and a prefix that says how many digits come (NumeroLogic, arXiv 2404.00459), so
the model knows a digit's place before writing it. :func:`write_numbers` rewrites every number of a text into one
of these forms and :func:`read_numbers` undoes it exactly: ``read_numbers(write_numbers(s, o, c), o, c) == s`` for
every string ``s``. :func:`written_places` gives each character of a written text the place of the digit it is
(the place ``delft.numbers.digits.run_places`` gives that digit in the natural text), so the digit losses and
inspect can score a reversed or prefixed digit at its true place. Only ASCII digits are digits here.
:func:`write_last_number` and :func:`read_last_number` do the same to a text's last number only
(``data.numbers.scope: answer``, the final answer of a completion).

**Reversed** (``order="reversed"``, no prefix). A *run* is a maximal stretch of ASCII digits joined by single
``.`` or ``,`` characters (``[0-9]+([.,][0-9]+)*``). Each run is written back to front, character by character;
everything else stays. A sign stays in front because it is not part of the run, and the decimal point stays
between the units and the tenths digit, so the digits are written in ascending place, tenths before units:

    42            -> 24                 -1234.5       -> -5.4321           3.14159  -> 95141.3
    1,234,567     -> 765,432,1          $1,000        -> $000,1            x12y     -> x21y
    \frac{3}{4}   -> \frac{3}{4}        3rd and 47th  -> 3rd and 74th      0.05     -> 50.0
    (3,4) and 1.2.3 -> (4,3) and 3.2.1  (numbers glued by "," or "." are one run and are reversed as one)

Why runs and not numbers: reversed number by number, the thousands chain ``4,567`` (``765,4``) and the list
``567,4`` (``765`` ``,`` ``4``) would be written alike, and no reader could tell them apart. Reversing whole runs
keeps every written text readable back, since a run's reversal is again a run of the same extent (its ends are
digits and its neighbours are unchanged). Reading a reversed text is the same operation: every run is reversed
again.

**Count prefix** (``count_prefix=True``, NumeroLogic). Every *number* (an integer ``[0-9]+``, or a thousands chain
``1,234,567`` whose groups are the scorer's and the losses', see ``delft.numbers.digits``, with an optional
``.fraction``) is wrapped as ``{n:number}``, n the count of its integer digits; a number with a fraction carries
both counts, ``{n.m:number}`` (NumeroLogic's form for floats). Separators are not counted, a sign stays outside:

    42 -> {2:42}    -1234.5 -> -{4.1:1234.5}    1,234,567 -> {7:1,234,567}    x2y -> x{1:2}y    1.2.3 -> {1.1:1.2}.{1:3}

With both (``order="reversed", count_prefix=True``) each wrapped number is reversed inside its braces and the
counts keep their order (integer digits first): ``1234.5 -> {4.1:5.4321}``, ``1,234 -> {4:432,1}``; the braces
delimit the numbers, so lists keep their order: ``3,4 -> {1:3},{1:4}``.

Reading a prefixed text unwraps every ``{counts:body}`` whose body is digits, ``.`` and ``,``, whatever the counts
say (a model's wrong count is dropped, not kept). No text is read wrongly: in a written text every digit of the
original sits inside a wrapper, so a ``{`` followed by a digit always opens one.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from delft.numbers.digits import ascii_digits, run_places

ORDERS = ("natural", "reversed")


_RUN = re.compile(r"[0-9]+(?:[.,][0-9]+)*")


# A number as the scorer and the losses read it: a thousands chain (first group 1-3 digits not after a digit or a
# '.', then groups of exactly 3, the last not followed by a digit) or plain digits, then an optional fraction.
_NUMBER = re.compile(r"(?P<int>(?<![.0-9])[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.(?P<frac>[0-9]+))?")


_WRAPPED = re.compile(r"\{[0-9]+(?:\.[0-9]+)?:(?P<body>[0-9][0-9.,]*)\}")


# For each character of a produced text, the index of the input character it came from (None: a character the
# rewrite added, the braces and counts of a prefix).
Sources = list[Optional[int]]


# Where a piece's characters came from, in parts (ranges of input indices, or Nones for added characters): a
# range costs nothing per character, so writing a text without its sources stays linear in the text's bytes.
Parts = tuple[Iterable[Optional[int]], ...]


def _check(order: str, count_prefix: bool) -> None:
    if order not in ORDERS:
        raise ValueError(f"number order must be one of {ORDERS}, not {order!r}")
    if not isinstance(count_prefix, bool):
        raise ValueError(f"count_prefix must be True or False, not {count_prefix!r}")


def _rewrite(text: str, pattern: re.Pattern, piece: Callable[[re.Match], tuple[str, Parts]],
             sources: Optional[Sources] = None) -> str:
    """``text`` with every match of ``pattern`` replaced by ``piece(match)``; where each output character came
    from is appended to ``sources`` when one is given. The output is built in one growing buffer and the matches
    are read one at a time, so a long text costs a few times its own size, not a Python object per character."""
    out = io.StringIO()
    at = 0
    for m in pattern.finditer(text):
        out.write(text[at:m.start()])
        written, parts = piece(m)
        out.write(written)
        if sources is not None:
            sources.extend(range(at, m.start()))
            for part in parts:
                sources.extend(part)
        at = m.end()
    out.write(text[at:])
    if sources is not None:
        sources.extend(range(at, len(text)))
    return out.getvalue()


def _reversed_span(m: re.Match, start: int, end: int) -> tuple[str, Parts]:
    """The characters ``start..end`` of the matched text, back to front."""
    return m.string[start:end][::-1], (range(end - 1, start - 1, -1),)


def _wrap(m: re.Match, order: str) -> tuple[str, Parts]:
    integer, fraction = m.group("int"), m.group("frac")
    counts = str(len(integer) - integer.count(",")) + ("" if fraction is None else f".{len(fraction)}")
    if order == "reversed":
        body, (body_sources,) = _reversed_span(m, m.start(), m.end())
    else:
        body, body_sources = m.group(0), range(m.start(), m.end())
    head = "{" + counts + ":"
    return head + body + "}", ([None] * len(head), body_sources, [None])


def _unwrap(m: re.Match, order: str) -> tuple[str, Parts]:
    start, end = m.span("body")
    if order == "reversed":
        return _reversed_span(m, start, end)
    return m.group("body"), (range(start, end),)


def _convert(text: str, order: str, count_prefix: bool, reading: bool, sources: Optional[Sources] = None) -> str:
    """Write (``reading`` False) or read back the numbers of ``text``; each output character's source index is
    appended to ``sources`` when one is given (only the per-character views ask: their texts are short)."""
    _check(order, count_prefix)
    if count_prefix and reading:
        return _rewrite(text, _WRAPPED, lambda m: _unwrap(m, order), sources)
    if count_prefix:
        return _rewrite(text, _NUMBER, lambda m: _wrap(m, order), sources)
    if order == "reversed":  # reversing a run is its own inverse
        return _rewrite(text, _RUN, lambda m: _reversed_span(m, m.start(), m.end()), sources)
    if sources is not None:
        sources.extend(range(len(text)))
    return text


def write_numbers(text: str, order: str = "natural", count_prefix: bool = False) -> str:
    """``text`` with every number written in the given form (module docstring): ``write_numbers("12+9=21",
    "reversed") == "21+9=12"``, ``write_numbers("12+9=21", count_prefix=True) == "{2:12}+{1:9}={2:21}"``."""
    return _convert(text, order, count_prefix, reading=False)


def read_numbers(text: str, order: str = "natural", count_prefix: bool = False) -> str:
    """The natural text a written one stands for: the inverse of :func:`write_numbers` with the same form."""
    return _convert(text, order, count_prefix, reading=True)


def _natural_index(text: str, order: str, count_prefix: bool) -> tuple[str, Sources]:
    """The natural text, and for every character of the written ``text`` the index of the natural character it
    is (None for a prefix's characters, which stand for nothing in the natural text)."""
    sources: Sources = []
    natural = _convert(text, order, count_prefix, True, sources)
    index: Sources = [None] * len(text)
    for j, i in enumerate(sources):
        index[i] = j
    return natural, index


def written_places(text: str, order: str = "natural", count_prefix: bool = False) -> list[Optional[int]]:
    """The true place of every character of a written text (None for anything that is not a digit of a number).

    A digit's place is the one ``run_places`` gives it in the natural text (:func:`read_numbers`): 1 = units,
    2 = tens, -1 = tenths. A count prefix's characters (braces, counts, their point and colon) are None, as are
    separators, points and other text. So ``"{2:24}"`` (reversed, prefixed 42) -> [None, None, None, 1, 2, None];
    in the natural form the places are those of ``run_places`` itself. The losses thus see the same places in
    every form, also where ``run_places`` follows the DEL reference rather than the prefix: in a run with a second
    point (``1.2.3``, ``.532.366``) places count characters from the first point, or, in a run that starts with a
    point, from the run's end, while the prefix counts the number the scorer reads (``{1.1:1.2}.{1:3}``).
    """
    natural, index = _natural_index(text, order, count_prefix)
    places = run_places(list(natural))
    return [None if j is None else places[j] for j in index]


def token_written_places(texts: list[Optional[str]], colons: list[bool],
                         count_prefix: bool) -> list[tuple[Optional[int], ...]]:
    """The token view of a reversed text's places (``delft.numbers.digits.token_places`` reads natural ones):
    ``texts[t]`` is token t's digits, '.' or ',' (None for any other token), ``colons[t]`` whether it is ':'.

    Each run of digits is read back to front, so its characters get the places :func:`written_places` gives them.
    With a count prefix, a run right before a ':' is the counts of ``{n:...}`` (every number is wrapped, so no
    other run meets a colon): the counts are their own small number, written naturally, and its digits get the
    places of that number (``{12:...}``: 2 and 1) rather than None: they are number tokens the digit losses score
    like any other, and the count of a number's digits is itself a number whose closeness matters. So
    ``{2:24}`` (42 reversed) -> [(), (1,), (), (1,), (2,), ()] and ``5.4321`` -> places -1, None, 1, 2, 3, 4.
    """
    chars: list[str] = []
    owners: list[int] = []
    for t, (text, colon) in enumerate(zip(texts, colons)):
        piece = text or (":" if colon else " ")  # a break: no run crosses another token
        chars.extend(piece)
        owners.extend([t] * len(piece))
    line = "".join(chars)
    counts = [m.span() for m in _RUN.finditer(line) if line.startswith(":", m.end())] if count_prefix else []
    masked = list(line)
    for a, b in counts:
        masked[a:b] = " " * (b - a)
    places = written_places("".join(masked), "reversed", False)
    for a, b in counts:
        places[a:b] = run_places(list(line[a:b]))
    out: list[list[Optional[int]]] = [[] for _ in texts]
    for t, place in zip(owners, places):
        if texts[t]:
            out[t].append(place)
    return [tuple(p) for p in out]


def prefix_characters(text: str, order: str = "natural", count_prefix: bool = False) -> list[bool]:
    """For every character of a written text: is it part of a count prefix (``{``, the counts, ``:``, ``}``)? Those
    characters are written digits that are no digit of the number, which the losses must not score as one."""
    return [j is None for j in _natural_index(text, order, count_prefix)[1]]


def _last_only(text: str, pattern: re.Pattern, piece: Callable[[re.Match], tuple[str, Parts]]) -> str:
    """``text`` with only the last match of ``pattern`` replaced by ``piece(match)`` (matches read one at a time:
    a line of many numbers keeps none but the last)."""
    m = None
    for m in pattern.finditer(text):
        pass
    if m is None:
        return text
    return "".join((text[:m.start()], piece(m)[0], text[m.end():]))


def write_last_number(text: str, order: str = "natural", count_prefix: bool = False) -> str:
    """``text`` with only its last number written in the given form: the final answer of a completion (a bare
    answer, ``#### 72``, a worked solution's closing number), the one the answer scorer's last-number rule reads.
    Reversed, the last run is written back to front; prefixed, the last number is wrapped."""
    return _rewrite_last(text, order, count_prefix, _NUMBER, lambda m: _wrap(m, order))


def read_last_number(text: str, order: str = "natural", count_prefix: bool = False) -> str:
    """The inverse of :func:`write_last_number`: only the last written number (run or wrapper) is read back."""
    return _rewrite_last(text, order, count_prefix, _WRAPPED, lambda m: _unwrap(m, order))


def _rewrite_last(text: str, order: str, count_prefix: bool, prefixed, piece) -> str:
    """What writing and reading the last number share: with count_prefix, the last match of ``prefixed`` rewritten by
    ``piece`` (wrapped, or unwrapped); reversed alone, the last run turned round (its own inverse); else the text."""
    _check(order, count_prefix)
    if count_prefix:
        return _last_only(text, prefixed, piece)
    if order == "reversed":
        return _last_only(text, _RUN, lambda m: _reversed_span(m, m.start(), m.end()))
    return text


@dataclass(frozen=True)
class NumberForm:
    """How a run writes its numbers (``data.numbers``): the digit order, the count prefix, and the scope, which
    numbers are written so: the completion's last (answer), every number of the completion (completion), or the
    prompts' too (everything). It owns the scope rule, so the training data, eval, held-out accuracy, GRPO's
    rewards, inspect and export read a run's numbers alike. Digits of other scripts are written (and read) as ASCII
    digits first: the forms reverse and count ASCII digits only."""

    order: str = "natural"
    count_prefix: bool = False
    scope: str = "completion"

    @classmethod
    def of(cls, numbers) -> "NumberForm":
        """The form of a recipe's data.numbers section (or anything with its three fields)."""
        return cls(numbers.order, numbers.count_prefix, numbers.scope)

    @property
    def active(self) -> bool:
        """Whether any number is written other than naturally."""
        return self.order != "natural" or self.count_prefix

    @property
    def writes_prompts(self) -> bool:
        """Whether the prompts' numbers are written in the form too (scope everything)."""
        return self.active and self.scope == "everything"

    @property
    def reader(self) -> Callable[[str, str, bool], str]:
        """What reads a completion back: with scope answer its last number only, else every number."""
        return read_last_number if self.scope == "answer" else read_numbers

    def write_completion(self, text: str) -> str:
        """A completion with its numbers in the form (all of them, or with scope answer its last)."""
        if not self.active:
            return text
        write = write_last_number if self.scope == "answer" else write_numbers
        return write(ascii_digits(text), self.order, self.count_prefix)

    def read_completion(self, text: str) -> str:
        """A model's answer written in the form, as natural text for the scorer. Give it the text cut at the stop
        strings: with scope answer only the last number is read back, which must be the answer's."""
        if not self.active:
            return text
        return self.reader(ascii_digits(text), self.order, self.count_prefix)

    def write_question(self, text: str) -> str:
        """A question's text with its numbers written as the model saw its prompts (only with scope everything)."""
        return write_numbers(ascii_digits(text), self.order, self.count_prefix) if self.writes_prompts else text

    def describe(self, prefix: str = "count prefixes") -> str:
        """'reversed digits with count prefixes', 'natural digits'."""
        return f"{self.order} digits" + (f" with {prefix}" if self.count_prefix else "")
