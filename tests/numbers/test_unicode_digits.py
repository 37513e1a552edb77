"""One notion of a digit (issue 51, item 7): the scorer, the number formats and the losses read an Arabic-Indic,
Persian, Devanagari or full-width digit as its ASCII digit, so a reversed or count-prefixed answer in those digits is
read back like an ASCII one, and a data file written in them trains on the same tokens and digit labels as its
ASCII twin. The real scorer, real forms and the tiny character-level tokenizer."""

from __future__ import annotations

from decimal import Decimal

import pytest

from delft.data.batches import tokenize_example
from delft.data.prompts import read_completion, written_completion, written_question
from delft.data.sources import Example
from delft.numbers.answers import extract_answer, parse_number
from delft.numbers.digits import ascii_digits
from delft.numbers.tokens import IGNORE
from delft.recipe.schema import DataConfig

SCRIPTS = {
    "arabic-indic": "٠١٢٣٤٥٦٧٨٩",
    "persian": "۰۱۲۳۴۵۶۷۸۹",
    "devanagari": "०१२३४५६७८९",
    "full-width": "０１２３４５６７８９",
}
FORMS = {
    "reversed": {"order": "reversed"},
    "reversed, answer only": {"order": "reversed", "scope": "answer"},
    "count prefix": {"count_prefix": True},
    "reversed with prefix": {"order": "reversed", "count_prefix": True},
}


def in_script(text: str, script: str) -> str:
    return text.translate(str.maketrans("0123456789", SCRIPTS[script]))


def data(**numbers) -> DataConfig:
    return DataConfig(source="sums.jsonl", format="prompt_completion", template="plain", numbers=numbers)


def test_ascii_digits_maps_every_script_one_character_for_one():
    for script, digits in SCRIPTS.items():
        assert ascii_digits(f"x{digits}.") == "x0123456789.", script
    assert ascii_digits("x² ½ 12") == "x² ½ 12"  # superscripts and fractions are no decimal digits


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("form", FORMS)
def test_the_scorer_reads_an_answer_in_other_digits_as_the_ascii_one(form, script):
    cfg = data(**FORMS[form])
    written = written_completion("The total is 1,234.5", cfg)  # what the model learned to write
    assert written.isascii() and written != "The total is 1,234.5"
    ascii_read = extract_answer(read_completion(written, cfg))
    other_read = extract_answer(read_completion(in_script(written, script), cfg))
    assert ascii_read.value == other_read.value == Decimal("1234.5"), (written, other_read)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scorer_reads_other_digits_in_the_natural_form_and_in_gold(script):
    found = extract_answer(in_script("so the answer is 42.", script))
    assert found.value == 42 and found.text == "42"
    assert parse_number(in_script("1,234", script)) == 1234


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("form", FORMS)
def test_data_in_other_digits_trains_as_its_ascii_twin(form, script, tiny_tokenizer):
    cfg = data(**FORMS[form], **({"scope": "everything"} if "scope" not in FORMS[form] else {}))
    ascii_ex = Example("What is 1200 + 34.5?", "The total is 1,234.5", None, 0)
    everything = cfg.numbers.scope == "everything"  # else the prompt is the model's as written, digits and all
    other_ex = Example(in_script(ascii_ex.prompt, script) if everything else ascii_ex.prompt,
                       in_script(ascii_ex.completion, script), None, 0)
    assert written_completion(other_ex.completion, cfg) == written_completion(ascii_ex.completion, cfg)
    assert written_question(other_ex.prompt, cfg) == written_question(ascii_ex.prompt, cfg)
    got, want = tokenize_example(other_ex, tiny_tokenizer, cfg), tokenize_example(ascii_ex, tiny_tokenizer, cfg)
    assert got.input_ids == want.input_ids and got.labels == want.labels
    digit_ids = {tiny_tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    written = written_completion(ascii_ex.completion, cfg)
    assert sum(1 for t in got.labels if t != IGNORE and t in digit_ids) == sum(c.isdigit() for c in written) >= 5
    # both sides alike: the gold read from the data file is what the scorer reads from the written answer
    assert extract_answer(read_completion(written_completion(other_ex.completion, cfg), cfg)).value == \
        parse_number(in_script("1,234.5", script))
