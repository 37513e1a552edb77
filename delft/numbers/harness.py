"""GSM8K's two scores as lm-evaluation-harness defines them (its ``gsm8k`` task, version 3.0), beside delft's own.

The harness does not read numbers: it extracts a *string* with a regular expression, deletes a few patterns from
both the extracted string and the reference, lower-cases both and compares them as strings:

- ``strict-match``: the first ``#### N`` (regex ``#### (\\-?[0-9\\.\\,]+)``);
- ``flexible-extract``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` (the last number-like run);
- either finds nothing: the string ``[invalid]``, which matches no reference;
- then ``,``, ``$``, everything up to and including ``#### `` and one trailing ``.`` are deleted from both.

So ``$5.00`` against gold ``5`` is wrong for the harness (the strings ``5.00`` and ``5`` differ) and right for
delft's exact match, which compares numbers. docs/evaluation.md#gsm8ks-two-scores-lm-evaluation-harness lists the
differences. No torch here.
"""

from __future__ import annotations

import re
from typing import Optional

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
FALLBACK = "[invalid]"  # what the harness's regex filter returns when nothing matches
IGNORED = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def _select(regex: re.Pattern, text: str, which: int) -> str:
    """The harness's RegexFilter: ``findall``, the match at ``which``; of a tuple of groups the first non-empty."""
    found = regex.findall(text)
    if not found:
        return FALLBACK
    match = found[which]
    if isinstance(match, tuple):
        match = next((m for m in match if m), FALLBACK)
    return match.strip()


def strict_extract(text: str) -> str:
    """What the harness's ``strict-match`` filter keeps of a response: the number after the first ``#### ``."""
    return _select(STRICT, text, 0)


def flexible_extract(text: str) -> str:
    """What the harness's ``flexible-extract`` filter keeps: the last number-like run."""
    return _select(FLEXIBLE, text, -1)


def normalise(text: str) -> str:
    """The harness's exact_match preprocessing (regexes_to_ignore in order, then ignore_case)."""
    for regex in IGNORED:
        text = regex.sub("", text)
    return text.lower()


def reference(gold_text: str) -> str:
    """The string a prediction must equal: the gold answer (a GSM8K answer whole, ``#### 72`` included) normalised."""
    return normalise(gold_text)


def harness_match(extracted: str, gold_text: str) -> bool:
    """The harness's exact_match of one filtered response against one reference."""
    return normalise(extracted) == reference(gold_text)


def harness_scores(text: str, gold_text: Optional[str]) -> tuple[Optional[bool], Optional[bool]]:
    """(strict-match, flexible-extract) of one response; (None, None) without a gold text."""
    if gold_text is None:
        return None, None
    return harness_match(strict_extract(text), gold_text), harness_match(flexible_extract(text), gold_text)
