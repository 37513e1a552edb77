r"""Number formats (delft/numbers/formats.py): the written forms, their exact inverse and the true place of every
written digit, on hand-worked cases and on thousands of seeded random strings built from the number forms the
answer scorer reads (separators, decimals, signs, 30-digit numbers, numbers inside words, LaTeX)."""

from __future__ import annotations

import random
import re

import pytest

from delft.numbers.digits import run_places
from delft.numbers.formats import (
    ORDERS,
    prefix_characters,
    read_last_number,
    read_numbers,
    write_last_number,
    write_numbers,
    written_places,
)

FORMS = [(order, prefix) for order in ORDERS for prefix in (False, True)]


# Every form of a number delft.numbers.answers reads, and the text around numbers in GSM8K-style solutions.
HAND = [
    "42", "-42", "0", "007", "1,234,567", "-1,234,567.89", "$1,000", "-$3", "$-3", "3.14159", "0.05", ".5", "5.",
    "123456789012345678901234567890", "The answer is 1,234.", "#### 72", r"\boxed{18}", r"\frac{3}{4}", "$1,000",
    "x2y", "3rd", "H2O", "12.5%", "3/4", "1 1/2", "1e5", "2.5E-3", "5-3", "\u22123", "(3,4)", "1,2,3", "1.2.3",
    "1..5", "12,3456", "1234,567", "123,4", "1.5,000", ".123,456", "1,234,5678", "0.123,456", "{2:42}", "{1:}",
    "{3:-}", "{{7}}", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "", "no numbers here",
]


@pytest.mark.parametrize("order,prefix", FORMS)
@pytest.mark.parametrize("text", HAND)
def test_hand_written_forms_read_back(text, order, prefix):
    written = write_numbers(text, order, prefix)
    assert read_numbers(written, order, prefix) == text
    assert len(written_places(written, order, prefix)) == len(written)


WORKED = [  # (natural, order, prefix, written)
    ("42", "reversed", False, "24"),
    ("-1234.5", "reversed", False, "-5.4321"),
    ("3.14159", "reversed", False, "95141.3"),
    ("1,234,567", "reversed", False, "765,432,1"),
    ("$1,000", "reversed", False, "$000,1"),
    ("x12y", "reversed", False, "x21y"),
    (r"\frac{3}{4}", "reversed", False, r"\frac{3}{4}"),
    ("3rd and 47th", "reversed", False, "3rd and 74th"),
    ("0.05", "reversed", False, "50.0"),
    ("(3,4) and 1.2.3", "reversed", False, "(4,3) and 3.2.1"),
    ("12+9=21", "reversed", False, "21+9=12"),
    ("42", "natural", True, "{2:42}"),
    ("-1234.5", "natural", True, "-{4.1:1234.5}"),
    ("1,234,567", "natural", True, "{7:1,234,567}"),
    ("x2y", "natural", True, "x{1:2}y"),
    ("1.2.3", "natural", True, "{1.1:1.2}.{1:3}"),
    ("12+9=21", "natural", True, "{2:12}+{1:9}={2:21}"),
    (r"\frac{3}{4}", "natural", True, r"\frac{{1:3}}{{1:4}}"),
    ("{2:42}", "natural", True, "{{1:2}:{2:42}}"),
    ("1234.5", "reversed", True, "{4.1:5.4321}"),
    ("1,234", "reversed", True, "{4:432,1}"),
    ("3,4", "reversed", True, "{1:3},{1:4}"),
    ("$1,000", "reversed", True, "${4:000,1}"),
]


@pytest.mark.parametrize("natural,order,prefix,written", WORKED)
def test_the_documented_worked_examples(natural, order, prefix, written):
    assert write_numbers(natural, order, prefix) == written
    assert read_numbers(written, order, prefix) == natural


PLACES = [  # (written, order, prefix, places)
    ("1,234.5", "natural", False, [4, None, 3, 2, 1, None, -1]),
    ("24", "reversed", False, [1, 2]),
    ("-5.4321", "reversed", False, [None, -1, None, 1, 2, 3, 4]),
    ("765,432,1", "reversed", False, [1, 2, 3, None, 4, 5, 6, None, 7]),
    ("50.0", "reversed", False, [-2, -1, None, 1]),
    ("x21y", "reversed", False, [None, 1, 2, None]),
    ("{2:42}", "natural", True, [None, None, None, 2, 1, None]),
    ("-{4.1:1234.5}", "natural", True, [None] * 6 + [4, 3, 2, 1, None, -1, None]),
    ("{7:1,234,567}", "natural", True, [None] * 3 + [7, None, 6, 5, 4, None, 3, 2, 1, None]),
    ("{2:24}", "reversed", True, [None, None, None, 1, 2, None]),
    ("{4.1:5.4321}", "reversed", True, [None] * 5 + [-1, None, 1, 2, 3, 4, None]),
    ("{4:432,1}", "reversed", True, [None] * 3 + [1, 2, 3, None, 4, None]),
    ("{3:42}", "natural", True, [None, None, None, 2, 1, None]),  # a wrong count is still a prefix
]


@pytest.mark.parametrize("written,order,prefix,places", PLACES)
def test_hand_worked_places(written, order, prefix, places):
    assert written_places(written, order, prefix) == places


def test_a_count_prefix_is_marked_as_no_digit_of_the_number():
    marks = prefix_characters("a{12:123456789012}b", "natural", True)
    assert marks == [False] + [True] * 4 + [False] * 12 + [True, False]
    assert prefix_characters("{1.2:1.25}", "reversed", True) == [True] * 5 + [False] * 4 + [True]
    assert prefix_characters("{2:42}", "natural", False) == [False] * 6  # without prefixes, braces are text
    assert written_places("{2:42}", "natural", True)[1] is None  # the count's digit has no place


def _number(rng: random.Random) -> str:
    """One number in a form the answer scorer reads (sign, "$", separators, fraction, up to 30 digits)."""
    n = rng.choice([1, 1, 2, 3, 4, 7, 12, 30])
    digits = str(rng.randrange(10 ** (n - 1) if n > 1 else 0, 10 ** n))
    if rng.random() < 0.3:
        digits = f"{int(digits):,}"
    if rng.random() < 0.3:
        digits += "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))
    return rng.choice(["", "", "-", "$", "-$", "\u2212"]) + digits + rng.choice(["", "", "%", "."])


GLUE = ["", " ", ", ", ",", ".", "..", " + ", "-", "x", "rd ", "{", "}", ":", "{1:", r"\frac{", "}{", "$", "\n",
        "#### ", "<<", "=", "/", "e", "H", "(", ")"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(GLUE) + (_number(rng) if rng.random() < 0.8 else "") for _ in range(rng.randint(0, 8)))


def _adversarial(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789.,{}:-$x ") for _ in range(rng.randint(0, 24)))


@pytest.mark.parametrize("order,prefix", FORMS)
def test_random_texts_read_back(order, prefix):
    rng = random.Random(f"formats/{order}/{prefix}")
    for _ in range(3000):
        text = _text(rng) if rng.random() < 0.6 else _adversarial(rng)
        written = write_numbers(text, order, prefix)
        assert read_numbers(written, order, prefix) == text, (text, written)


@pytest.mark.parametrize("order,prefix", FORMS)
def test_the_written_digits_are_the_original_digits_at_their_places(order, prefix):
    """Every digit of the natural text appears once in the written one, with the place run_places gives it."""
    rng = random.Random(f"places/{order}/{prefix}")
    for _ in range(1000):
        text = _text(rng)
        written = write_numbers(text, order, prefix)
        places = written_places(written, order, prefix)
        ours = sorted((p, c) for c, p in zip(written, places) if p is not None)
        theirs = sorted((p, c) for c, p in zip(text, run_places(list(text))) if p is not None)
        assert ours == theirs, (text, written)
        assert all(c in "0123456789" for c, p in zip(written, places) if p is not None)


def test_natural_unprefixed_places_are_run_places():
    rng = random.Random(3)
    for _ in range(1000):
        text = _text(rng)
        assert written_places(text) == run_places(list(text))


def test_a_reversed_number_is_written_in_ascending_place():
    rng = random.Random(4)
    for _ in range(1000):
        n = rng.randint(1, 30)
        number = str(rng.randrange(10 ** (n - 1), 10 ** n)) + rng.choice(["", ".25", ".0007"])
        for prefix in (False, True):
            written = write_numbers(number, "reversed", prefix)
            places = [p for p in written_places(written, "reversed", prefix) if p is not None]
            assert places == sorted(places) and len(places) == len(number.replace(".", ""))


def test_the_counts_are_the_integer_and_fraction_digits():
    rng = random.Random(5)
    for _ in range(1000):
        text = _text(rng)
        if any(run.rstrip(".").count(".") > 1 for run in re.findall(r"[0-9.]+", text)):  # a second point, below
            continue
        for order in ORDERS:
            written = write_numbers(text, order, True)
            places = written_places(written, order, True)
            for m in re.finditer(r"\{(\d+)(?:\.(\d+))?:[\d.,]+\}", written):
                inside = [p for p in places[m.start():m.end()] if p is not None]
                assert int(m.group(1)) == sum(p > 0 for p in inside)
                assert int(m.group(2) or 0) == sum(p < 0 for p in inside)


@pytest.mark.parametrize("order,prefix", FORMS)
def test_text_without_numbers_is_unchanged(order, prefix):
    rng = random.Random(6)
    for text in ["", "no numbers here", "{a:b}", "x.y,z", r"\frac{a}{b}", "$-", "٣ is not ASCII"]:
        assert write_numbers(text, order, prefix) == text == read_numbers(text, order, prefix)
    for _ in range(500):
        text = "".join(rng.choice("abc .,{}:-$\\\n\u2212") for _ in range(rng.randint(0, 30)))
        assert write_numbers(text, order, prefix) == text == read_numbers(text, order, prefix)


def test_the_natural_unprefixed_form_is_the_identity():
    assert write_numbers("1,234.5 and x2") == "1,234.5 and x2" == read_numbers("1,234.5 and x2")


def test_unknown_forms_are_refused():
    with pytest.raises(ValueError, match="number order"):
        write_numbers("1", "backwards")
    with pytest.raises(ValueError, match="count_prefix"):
        read_numbers("1", "natural", "yes")


def test_a_second_point_keeps_run_places_convention():
    """In "1.2.3" the prefix counts the number the scorer reads (1.2, then 3), while the place of the 3 is the one
    run_places gives it (-3, the DEL reference's rule: places count characters from the first point; a run that
    starts with a point has none): the losses see the same places in every form."""
    assert write_numbers("1.2.3", "natural", True) == "{1.1:1.2}.{1:3}"
    assert written_places("{1.1:1.2}.{1:3}", "natural", True)[-2] == run_places(list("1.2.3"))[-1] == -3
    assert write_numbers(".532.366", "natural", True) == ".{3.3:532.366}"
    assert written_places(".{3.3:532.366}", "natural", True)[6] == run_places(list(".532.366"))[1] == 7


LAST = [  # (natural, order, prefix, written): only the last number, the completion's final answer
    ("12+9=21", "reversed", False, "12+9=12"),
    ("The sum is 1,012.5\n#### 1,012.5", "reversed", False, "The sum is 1,012.5\n#### 5.210,1"),
    ("a 12 b 34 c", "natural", True, "a 12 b {2:34} c"),
    ("#### -1234.5", "reversed", True, "#### -{4.1:5.4321}"),
    ("no numbers", "reversed", True, "no numbers"),
    ("12+9=21", "natural", False, "12+9=21"),
]


@pytest.mark.parametrize("natural,order,prefix,written", LAST)
def test_only_the_last_number_is_written_and_read_back(natural, order, prefix, written):
    assert write_last_number(natural, order, prefix) == written
    assert read_last_number(written, order, prefix) == natural


@pytest.mark.parametrize("order,prefix", FORMS)
@pytest.mark.parametrize("text", HAND)
def test_the_last_number_reads_back_on_every_hand_written_form(text, order, prefix):
    assert read_last_number(write_last_number(text, order, prefix), order, prefix) == text
