"""The number forms (delft/numbers/formats.py) on long lines: writing and reading a line of several MB costs a
small multiple of the line's own size (no Python object per character), and writes what short lines do."""

from __future__ import annotations

import tracemalloc

import pytest

from delft.numbers.formats import read_last_number, read_numbers, write_last_number, write_numbers

# A unit that ends outside any number, so a line of units is written unit by unit: thousands chains, fractions,
# signs, a run of two points, braces that are no wrapper
UNIT = "x 12,345.6 + -7 = {3} 1.2.3 and 1,000,000 items; "

FORMS = [("reversed", False), ("natural", True), ("reversed", True)]

# Bytes of working memory per character of the line: the output and a few copies of a number fit; the rewrite
# this replaced kept a list of source indices and a piece per match, 40-70 bytes a character
PER_CHARACTER = 8


def _peak(call, *args) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = call(*args)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("order,count_prefix,size", [
    ("reversed", False, 1_000_000), *[pytest.param(*form, 3_000_000, marks=pytest.mark.slow) for form in FORMS]])
def test_a_long_line_of_numbers_is_written_and_read_in_linear_memory(order, count_prefix, size):
    copies = size // len(UNIT)  # about 60,000 numbers a MB, each rewritten (tracemalloc slows that down)
    line = UNIT * copies
    written, peak = _peak(write_numbers, line, order, count_prefix)
    assert written == write_numbers(UNIT, order, count_prefix) * copies
    assert peak < PER_CHARACTER * len(line)
    read, peak = _peak(read_numbers, written, order, count_prefix)
    assert read == line and peak < PER_CHARACTER * len(written)
    last, peak = _peak(write_last_number, line, order, count_prefix)
    assert last == UNIT * (copies - 1) + write_last_number(UNIT, order, count_prefix)
    assert peak < PER_CHARACTER * len(line)
    assert _peak(read_last_number, last, order, count_prefix)[0] == line


@pytest.mark.parametrize("order,count_prefix", FORMS)
def test_one_number_of_millions_of_digits_is_written_in_linear_memory(order, count_prefix):
    line = "a " + "1234567890" * 800_000 + ".5 b"
    written, peak = _peak(write_numbers, line, order, count_prefix)
    assert peak < PER_CHARACTER * len(line)
    assert read_numbers(written, order, count_prefix) == line
    body = line[2:-2][::-1] if order == "reversed" else line[2:-2]
    assert written == "a " + (f"{{8000000.1:{body}}}" if count_prefix else body) + " b"
