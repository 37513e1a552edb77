"""The GRPO rewards on hand-worked cases: exact, and the place-weighted digit share behind `partial`."""

from __future__ import annotations

from decimal import Decimal

import pytest

from delft.numbers.rewards import completion_text, digit_reward, digit_share, exact_reward

# DEL's place weights (reference): units 2, tens 4, hundreds 6, thousands 8; tenths 1.02 ** -2.
TENTHS = 1.02 ** -2


@pytest.mark.parametrize("completion,gold,exact,share", [
    ("The answer is 37.", "37", 1.0, 1.0),
    ("36", "37", 0.0, 4 / 6),  # tens right (4 of 4 + 2)
    ("3.7", "37", 0.0, 0.0),  # aligned at the point: tens missing, units 3 is not 7, a tenths digit extra
    ("37", "3.7", 0.0, 0.0),  # the mirror: units 7 is not 3, tenths missing, tens extra
    ("1,234", "1234", 1.0, 1.0),  # thousands separators are read as delft eval reads them
    ("1243", "1234", 0.0, (8 + 6) / 20),  # thousands and hundreds right of 8 + 6 + 4 + 2
    ("137", "37", 0.0, 6 / 12),  # an extra leading digit counts against the share
    ("no idea", "37", 0.0, 0.0),  # no number
    ("-37", "-36", 0.0, 4 / 6),  # negative numbers: digits of the magnitudes
    ("-37", "37", 0.0, 0.0),  # a sign flip earns nothing
    ("12.5", "12.4", 0.0, (4 + 2) / (4 + 2 + TENTHS)),
])
def test_hand_worked_cases(completion, gold, exact, share):
    assert exact_reward([completion], [gold]) == [exact]
    assert digit_reward([completion], [gold]) == [pytest.approx(share)]


def test_conversational_completions_and_missing_golds():
    chat = [{"role": "assistant", "content": "It is 42."}]
    assert completion_text(chat) == "It is 42."
    assert exact_reward([chat, "42"], ["42", None]) == [1.0, None]  # no gold: unscorable, TRL leaves it out
    assert exact_reward.__name__ == "exact" and digit_reward.__name__ == "digits"


def test_share_is_a_share():
    assert digit_share(Decimal("999"), Decimal("999")) == 1.0
    assert 0.0 <= digit_share(Decimal("12345"), Decimal("54321")) <= 1.0
    assert digit_share(None, Decimal("5")) == 0.0
