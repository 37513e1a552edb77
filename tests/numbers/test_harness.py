"""lm-evaluation-harness's GSM8K scores (strict-match, flexible-extract) on hand-checked answers.

Each expected value was worked out by hand from the harness's gsm8k.yaml (version 3.0: its two regex filters, then
exact_match with regexes_to_ignore [",", "\\$", "(?s).*#### ", "\\.$"] and ignore_case), and the whole table was
checked once against lm-eval 0.4.13's own RegexFilter and exact_match in a scratch environment (lm-eval is not a
dependency of delft).
"""

from __future__ import annotations

import pytest

from delft.numbers.harness import FALLBACK, flexible_extract, harness_match, harness_scores, strict_extract

GOLD_72 = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"

# (gold text, response, strict-match, flexible-extract)
CASES = [
    (GOLD_72, " She sold 48 + 24 = 72 clips.\n#### 72", True, True),
    ("#### 1234", " 1000 + 234 = 1,234\n#### 1,234", True, True),  # commas are deleted from both sides
    ("#### 5", " The wallet costs $5.00.", False, False),  # the strings "5.00" and "5" differ
    ("#### 5", " It costs $5.", False, True),  # "$5." -> "5": "$" and one trailing "." deleted
    ("#### 18", " She makes 18 dollars.\n#### 18 dollars a day", True, True),  # text after the number
    ("#### 18", " The answer is 18. Next, question 2", False, False),  # no ####; the last number is 2
    ("#### 3", " He has 5 apples, eats 2, so 3 are left.", False, True),  # no ####: the last number
    ("#### 5", " 2 + 3 = 5\n#### 5.", True, True),  # "5." -> "5"
    ("#### -3", " 2 - 5 = -3\n#### -3", True, True),  # negative numbers
    ("#### 5", " #### $5", False, True),  # "$" after "#### " is not in the strict pattern
    ("#### 5", " #### 4\n#### 5", False, True),  # strict takes the first ####, flexible the last number
    ("#### 7", " seven", False, False),  # no number: "[invalid]"
    ("#### 0.5", " half: 0.50", False, False),  # no rounding: "0.50" is not "0.5"
]


def test_the_filters_take_what_the_harness_takes():
    assert strict_extract("x #### 1,234 and #### 9") == "1,234"
    assert flexible_extract("costs $5.00.") == "$5.00."
    assert flexible_extract("a 5 b 2, c 3") == "3"  # one digit: the second alternative
    assert strict_extract("no marker") == FALLBACK == flexible_extract("no digits")


@pytest.mark.parametrize("gold,response,strict,flexible", CASES)
def test_strict_and_flexible_match_the_harness(gold, response, strict, flexible):
    assert harness_scores(response, gold) == (strict, flexible)


def test_deleting_commas_can_join_two_numbers_as_the_harness_does():
    # "1,2" is one flexible match ("1,2") and normalises to "12": the harness counts it right; delft's own
    # exact match reads 1 and 2 (groups of three digits only) and does not.
    assert harness_scores(" 1,2", "#### 12") == (False, True)


def test_no_gold_text_gives_no_score():
    assert harness_scores("#### 5", None) == (None, None)
    assert harness_match("[invalid]", "#### 5") is False
