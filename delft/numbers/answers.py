r"""Numeric answers: extraction from generated text, scoring against a gold number, and the eval metrics.

No torch here (numpy for the bootstrap, math-verify only for LaTeX). The rules are documented in docs/evaluation.md#evaluating-delft-eval; every rule here has a test in
tests/test_answers.py.

Extraction (:func:`extract_answer`) tries, in order, and the first rule that yields a number wins:

1. ``"####"``      the first ``#### N`` (GSM8K's marker; first match, as lm-evaluation-harness' strict filter).
2. ``"boxed"``     the last ``\boxed{...}`` / ``\fbox{...}`` (as Qwen2.5-Math) whose content is a plain number
                   or fraction; ``"boxed_latex"`` when the content needed LaTeX parsing (``\frac{1}{2}``,
                   ``2\sqrt{2}``), done by math-verify.
3. ``"answer_is"`` the last "answer is N" / "answer: N" / "answer = N" (case-insensitive): the first number on
                   the rest of that line (or a ``$...$`` LaTeX value right after the phrase, via math-verify).
4. ``"last_number"`` the last number anywhere (lm-evaluation-harness' flexible filter).
5. ``"none"``      no number at all: its own outcome, scored wrong everywhere and counted in the no-number rate.

Before extracting, the text is cut at the first stop string after its leading whitespace (a run-on
continuation such as "\n\nQuestion: ..." is ignored).

A number is: an optional sign, an optional "$", digits with optional comma thousands groups ("1,234,567"; groups
must be 3 digits), an optional decimal part, an optional "/denominator" (simple fractions, "3/4" = 0.75), and
an optional "%" which is dropped (45% -> 45, not 0.45). A trailing sentence "." is not part of the number.
The minus sign ("-", or the Unicode minus) must touch the number ("-3", "-$3", "$-3") and must not follow a
digit, letter or closing bracket: "5-3" holds 5 and 3, "- 3" is 3. A number glued to a letter in front ("x2",
"H2O") is not a number; scientific notation ("1e5", "2.5E-3") is not read and the whole token is skipped.
European decimal commas ("1,5") and mixed numbers ("1 1/2") are not supported. Digits of other scripts
(Arabic-Indic "٤٢", full-width "４２") are read as their ASCII digits (delft.numbers.digits.ascii_digits), as the
number formats and the losses read them.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation, localcontext
from typing import Iterable, Optional

from delft.numbers.digits import ascii_digits, digits_by_place, exact_context

RULES = ("####", "boxed", "boxed_latex", "answer_is", "last_number", "none")


# Tolerance match (the DEL paper's / MAmmoTH's rule): integer gold needs round(pred) == gold, other gold a
# relative error of at most 4 %.
RELATIVE_TOLERANCE = Decimal("0.04")


# A number: 'neg'/'neg2' a sign, 'int' and 'frac'/'ffrac' the digits, 'den' a fraction's denominator.
_NUMBER = re.compile(
    r"""
    (?<![\w)\]}])(?<!\d\.)                 # not glued to a word, a closing bracket or "1." in front
    (?P<neg>[-\u2212])?                    # a sign touches the number ...
    \$?
    (?P<neg2>(?(neg)(?!)|[-\u2212]))?       # ... or stands after the "$" ("$-3")
    (?:
        (?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)   # 1,234,567 or 1234
        (?:
            \.(?P<frac>\d+)                      # 12.5 (a trailing "." is not taken)
          | \s*/\s*(?P<den>0*[1-9]\d*)(?![\d.,]\d)  # 3/4: integers only, denominator not 0
        )?
      | (?<![.\d])\.(?P<ffrac>\d+)         # .5 (not the ".3" of "1.2.3", not after "...")
    )
    (?![eE][-+]?\d)                        # not scientific notation
    """,
    re.VERBOSE,
)


_SCIENTIFIC = re.compile(r"(?<![\w.])[-\u2212]?\d+(?:\.\d+)?[eE][-+]?\d+")


_HASH = re.compile(r"####\s*")


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


_ANSWER_IS = re.compile(r"\banswer\b\s*(?:is\b|was\b|:|=)\s*:?", re.IGNORECASE)


_LATEX_SEGMENT = re.compile(r"^\s*(?:\*\*)?\s*(\$\$?|\\\(|\\\[)(.+?)(?:\$\$?|\\\)|\\\])")


# Cut points for run-on continuations. Plain prompts (base models) run on into the next problem; chat models
# end their turn with an end-of-turn token, which generation already stops at (see generate.stop_strings).
PLAIN_STOP_STRINGS = ("\n\n", "Question:", "\nQ:", "Problem:")


CHAT_STOP_STRINGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|im_start|>", "<|user|>", "</s>")


@dataclass(frozen=True)
class Extraction:
    """What was read from a generated text: the value (None = no number), the rule and the matched text."""

    value: Optional[Decimal]
    rule: str
    text: Optional[str] = None

    @property
    def canonical(self) -> Optional[str]:
        return None if self.value is None else canonical(self.value)


def canonical(value: Decimal) -> str:
    """Plain notation, no exponent, no trailing fraction zeros, no "-0": 1.500 -> "1.5", 1E+2 -> "100"."""
    if value == 0:
        return "0"
    with exact_context():  # normalize() rounds to the context's precision
        text = format(value.normalize(), "f")
    return text


def _divide(num: Decimal, den: Decimal) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 28
        return num / den


def _from_match(m: re.Match) -> Decimal:
    integer = (m.group("int") or "0").replace(",", "")
    frac = m.group("frac") if m.group("frac") is not None else m.group("ffrac")
    value = Decimal(integer + ("." + frac if frac is not None else ""))
    if m.group("den") is not None:
        value = _divide(value, Decimal(m.group("den")))
    return -value if (m.group("neg") or m.group("neg2")) else value


def _numbers(text: str) -> list[tuple[Decimal, re.Match]]:
    """Every number in ``text`` with its match, left to right (rules in the module docstring)."""
    masked = _SCIENTIFIC.sub(lambda s: " " * len(s.group(0)), text)  # keeps offsets
    return [(_from_match(m), m) for m in _NUMBER.finditer(masked)
            if m.group("int") is not None or m.group("ffrac") is not None]


def parse_number(text: Optional[str]) -> Optional[Decimal]:
    """The value of a text that is one number (gold answers, ``--set`` values): "1,234" -> 1234, "3/4" -> 0.75.

    Surrounding whitespace, "$", "%" and a trailing "." are allowed; anything else -> None.
    """
    if text is None:
        return None
    s = ascii_digits(str(text)).strip().rstrip(".").strip()
    s = s.replace("\\$", "$").replace("\\%", "%").rstrip("%").strip()
    s = re.sub(r"\{,\}", ",", s)
    if not s:
        return None
    found = _numbers(s)
    if len(found) != 1:
        try:  # "1E+2", "1e5" from a float's str(): gold answers may come from JSON floats
            value = Decimal(s)
            return value if value.is_finite() else None
        except InvalidOperation:
            return None
    value, m = found[0]
    rest = (s[: m.start()] + s[m.end():]).strip()
    return value if rest in ("", "$") else None


def cut_at_stop(text: str, stops: Iterable[str] = PLAIN_STOP_STRINGS) -> str:
    """``text`` up to the first stop string (which is dropped). Stop strings inside the leading whitespace do
    not count, so an answer that starts with a blank line is not cut to nothing."""
    body = len(text) - len(text.lstrip())
    cut = len(text)
    for s in stops:
        if s:
            i = text.find(s, body)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


def _math_verify_number(latex: str) -> Optional[Decimal]:
    """A LaTeX expression's numeric value via math-verify (None if it is not a finite number)."""
    try:
        import sympy
        from math_verify import parse
    except ImportError:  # pragma: no cover - math-verify is a dependency
        return None
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        parsed = parse(latex, parsing_timeout=timeout)
    except Exception:
        return None
    for expr in parsed:
        if isinstance(expr, str) or not isinstance(expr, sympy.Basic) or not expr.is_number:
            continue
        try:
            if expr.is_Rational:
                return _divide(Decimal(int(expr.p)), Decimal(int(expr.q)))
            value = sympy.N(expr, 30)
            if not value.is_real:
                continue
            d = Decimal(str(value))
            return d if d.is_finite() else None
        except (TypeError, ValueError, InvalidOperation, AttributeError):
            continue
    return None


def _balanced(text: str, open_at: int) -> Optional[str]:
    """Content of the brace group whose "{" is at ``open_at`` (None when unbalanced)."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1: i]
    return None


def _strip_latex_number(content: str) -> str:
    s = content.strip()
    for a, b in (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\ ", ""), ("\\$", "$"), ("\\%", "%"), ("$", "")):
        s = s.replace(a, b)
    s = re.sub(r"^\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}$", r"\1", s.strip())
    return s.strip()


def _boxed(text: str) -> Optional[Extraction]:
    starts = [m.end() - 1 for m in _BOXED.finditer(text)]
    for open_at in reversed(starts):  # last box first
        content = _balanced(text, open_at)
        if content is None:
            continue
        value = parse_number(_strip_latex_number(content))
        if value is not None:
            return Extraction(value, "boxed", content)
        value = _math_verify_number("\\boxed{" + content + "}")
        if value is not None:
            return Extraction(value, "boxed_latex", content)
        inner = _numbers(_strip_latex_number(content))
        if len(inner) == 1:  # "12 apples"
            return Extraction(inner[0][0], "boxed", content)
    return None


def _hash(text: str) -> Optional[Extraction]:
    for m in _HASH.finditer(text):
        rest = text[m.end():].split("\n", 1)[0]
        found = _numbers(rest)
        if found and not rest[: found[0][1].start()].strip(" $*:\t"):
            value, nm = found[0]
            return Extraction(value, "####", nm.group(0).strip())
    return None


def _answer_is(text: str) -> Optional[Extraction]:
    for m in reversed(list(_ANSWER_IS.finditer(text))):
        rest = text[m.end():].split("\n", 1)[0]
        latex = _LATEX_SEGMENT.match(rest)
        found = _numbers(rest)
        if latex and "\\" in latex.group(2) and (not found or found[0][1].start() > latex.start(2)):
            value = _math_verify_number("$" + latex.group(2) + "$")
            if value is not None:
                return Extraction(value, "answer_is", latex.group(2))
        if found:
            value, nm = found[0]
            return Extraction(value, "answer_is", nm.group(0).strip())
    return None


def extract_answer(text: str, stops: Iterable[str] = PLAIN_STOP_STRINGS) -> Extraction:
    """The numeric answer in a generated text, and the rule that found it (see the module docstring)."""
    text = ascii_digits(cut_at_stop(text or "", stops))
    for rule in (_hash, _boxed, _answer_is):
        got = rule(text)
        if got is not None:
            return got
    found = _numbers(text)
    if found:
        value, m = found[-1]
        return Extraction(value, "last_number", m.group(0).strip())
    return Extraction(None, "none", None)


def exact_match(pred: Optional[Decimal], gold: Decimal) -> bool:
    """Numeric equality (Decimal): 1.000 == 1, 0.75 == 3/4; no number is wrong."""
    return pred is not None and pred == gold


def is_integer(value: Decimal) -> bool:
    return value == value.to_integral_value()


def tolerance_match(pred: Optional[Decimal], gold: Decimal) -> bool:
    """The DEL paper's rule: integer gold needs round(pred) == gold (half to even, as Python's round);
    other gold needs |pred - gold| <= 4 % of |gold|. No number is wrong."""
    if pred is None:
        return False
    digits = len(pred.as_tuple().digits) + 2  # a model can write a number longer than any precision set in advance
    with exact_context(), localcontext() as ctx:  # quantize() fails past the context's precision
        ctx.prec = max(ctx.prec, digits)
        if is_integer(gold):
            return pred.quantize(Decimal(1), rounding=ROUND_HALF_EVEN) == gold
        return abs(pred - gold) <= RELATIVE_TOLERANCE * abs(gold)


def place_correct(pred: Optional[Decimal], gold: Decimal) -> dict[int, bool]:
    """For each digit place of the gold number (canonical form, sign dropped): is the prediction's digit there
    the same? A place the prediction lacks is wrong; no number is wrong at every place."""
    gold_digits = digits_by_place(canonical(gold))
    pred_digits = digits_by_place(canonical(pred)) if pred is not None else {}
    return {p: pred_digits.get(p) == d for p, d in gold_digits.items()}


def signed_log(value: Decimal) -> float:
    """sign(x) * log10(|x| + 1)."""
    if value == 0:
        return 0.0
    magnitude = float((abs(value) + 1).log10())
    return magnitude if value > 0 else -magnitude


@dataclass
class Scored:
    """One prediction against its gold answer."""

    gold: Decimal
    extraction: Extraction
    exact: bool = False
    tolerance: bool = False
    places: dict[int, bool] = field(default_factory=dict)
    strict: Optional[bool] = None  # lm-evaluation-harness's strict-match (delft.numbers.harness)
    flexible: Optional[bool] = None  # ... and its flexible-extract
    task_score: Optional[float] = None  # a generated task's own scorer (reasoning-gym's score_answer), in [0, 1]

    @property
    def has_number(self) -> bool:
        return self.extraction.value is not None


def score(extraction: Extraction, gold: Decimal,
          harness: tuple[Optional[bool], Optional[bool]] = (None, None)) -> Scored:
    """``extraction`` against ``gold``; ``harness`` carries the (strict-match, flexible-extract) flags along."""
    pred = extraction.value
    return Scored(gold, extraction, exact_match(pred, gold), tolerance_match(pred, gold), place_correct(pred, gold),
                  *harness)
