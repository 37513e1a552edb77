"""Verifiable numeric rewards for GRPO: ``exact`` and the digit share behind ``partial``, as TRL reward functions.

- ``exact``: 1 when delft's answer scorer (the one ``delft eval`` uses: delft.numbers.answers) reads the gold number
  from the completion, else 0.
- ``digits``: the place-weighted share of the gold's digits the answer has right, aligned at the decimal point
  (DEL's place weights, delft.numbers.digits.place_weight), over every place either number has, so digits written
  beyond the gold's places count against it (137 for 37 is half right, not wholly). An answer whose sign differs
  from the gold's, or with no number, gets 0.

The ``partial`` reward is both: ``exact`` plus alpha x ``digits``, each normalised within its group before they are
summed (TRL's ``multi_objective_aggregation="normalize_then_sum"`` with ``reward_weights=[1, alpha]``), so partial
credit cannot outweigh correctness. No torch here.

Both read the gold number from the row's ``answer`` column; ``functools.partial(exact_reward, answer_column="final")``
reads another (TRL logs a partial under its function's name), and rows without the column are refused by name.
"""

from __future__ import annotations

import functools
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence

from delft.errors import UserError
from delft.numbers.answers import (
    PLAIN_STOP_STRINGS,
    canonical,
    cut_at_stop,
    exact_match,
    extract_answer,
    parse_number,
)
from delft.numbers.digits import digits_by_place, place_weight

PARTIAL_ALPHA = 0.2  # the default weight of the digit share (the ceiling: partial credit stays a tie-break)


def completion_text(completion: Any) -> str:
    """A TRL completion as text: a string, or the content of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def digit_share(pred: Optional[Decimal], gold: Decimal, mode: str = "reference") -> float:
    """Place-weighted share of the gold's digits that ``pred`` has right, over the places of both numbers."""
    if pred is None or (pred < 0) != (gold < 0):
        return 0.0
    gold_digits, pred_digits = digits_by_place(canonical(abs(gold))), digits_by_place(canonical(abs(pred)))
    places = set(gold_digits) | set(pred_digits)
    total = sum(place_weight(p, mode) for p in places)
    right = sum(place_weight(p, mode) for p, d in gold_digits.items() if pred_digits.get(p) == d)
    return right / total if total else 0.0


def _golds(answer: Sequence[Any]) -> list[Optional[Decimal]]:
    return [parse_number(str(a)) if a is not None else None for a in answer]


def _reward(scorer, completions: Sequence[Any], answer: Sequence[Any], stops) -> list[Optional[float]]:
    """``scorer(pred, gold)`` per completion; None (unscorable, TRL leaves it out) where the gold is missing."""
    out: list[Optional[float]] = []
    for c, gold in zip(completions, _golds(answer)):
        if gold is None:
            out.append(None)
            continue
        out.append(float(scorer(extract_answer(completion_text(c), stops).value, gold)))
    return out


def _gold_column(answer, answer_column: str, columns: dict, reward: str) -> Sequence[Any]:
    """The gold numbers: TRL passes every dataset column as a keyword, so the one named ``answer_column``."""
    gold = answer if answer_column == "answer" else columns.get(answer_column)
    if gold is None:
        seen = sorted(k for k in columns if k not in ("prompts", "completion_ids", "trainer_state", "log_extra",
                                                       "log_metric", "environments"))
        raise UserError(f"the reward {reward!r} reads the gold number from the column {answer_column!r}, which the "
                        f"rows do not have (their other columns: {', '.join(seen) or 'none'})",
                        fix="Add that column, or read another: functools.partial(exact_reward, "
                        "answer_column=\"your_column\").")
    return gold


def exact_reward(completions: Sequence[Any], answer: Optional[Sequence[Any]] = None, stops=PLAIN_STOP_STRINGS, *,
                 answer_column: str = "answer", **kwargs) -> list[Optional[float]]:
    """TRL reward function ``exact``: 1.0 when the completion's number equals the row's ``answer`` (or
    ``answer_column``), else 0.0."""
    return _reward(exact_match, completions, _gold_column(answer, answer_column, kwargs, "exact"), stops)


def digit_reward(completions: Sequence[Any], answer: Optional[Sequence[Any]] = None, stops=PLAIN_STOP_STRINGS, *,
                 answer_column: str = "answer", **kwargs) -> list[Optional[float]]:
    """TRL reward function ``digits``: the place-weighted share of the answer's digits that are right."""
    return _reward(digit_share, completions, _gold_column(answer, answer_column, kwargs, "digits"), stops)


exact_reward.__name__, digit_reward.__name__ = "exact", "digits"  # the names TRL logs (rewards/exact/mean)


def read_back(reward, read: Callable[[str], str], stops=PLAIN_STOP_STRINGS):
    """``reward`` scoring each completion after ``read`` (a run's data.numbers form read back:
    delft.numbers.formats.NumberForm.read_completion) of its text cut at ``stops``, as eval reads a reversed or prefixed answer; same name for TRL's
    logs. The gold stays natural."""
    @functools.wraps(reward)  # its name for TRL's logs, and __wrapped__ for answer_column_of
    def read_then_score(completions: Sequence[Any], *args, **kwargs) -> list[Optional[float]]:
        return reward([read(cut_at_stop(completion_text(c), stops)) for c in completions], *args, stops=stops,
                      **kwargs)

    return read_then_score


def answer_column_of(reward) -> Optional[str]:
    """The column a delft reward (or a ``functools.partial`` of one, or one read_back wraps) reads the gold from;
    None for others."""
    column = None
    while isinstance(reward, functools.partial) or hasattr(reward, "__wrapped__"):
        if isinstance(reward, functools.partial):
            column = column or reward.keywords.get("answer_column")
            reward = reward.func
        else:
            reward = reward.__wrapped__
    return (column or "answer") if reward in (exact_reward, digit_reward) else None
