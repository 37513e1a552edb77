"""One rule for thousands separators: "1,234" is one number whose '1' is the thousands digit, for the losses'
place weights, teacher-forced eval, inspect and the answer scorer alike (GSM8K writes its answers this way)."""

from __future__ import annotations

import pytest
import torch
from tiny import build_tokenizer

from delft.numbers.answers import parse_number
from delft.numbers.digits import digits_by_place, place_weight, run_places
from delft.numbers.tokens import NumberVocab, number_targets

CASES = [  # text, the places of its digits in order (None: not a digit of a number)
    ("1,234", [4, 3, 2, 1]),
    ("$1,234.50", [4, 3, 2, 1, -1, -2]),
    ("1,000,000", [7, 6, 5, 4, 3, 2, 1]),
    ("3,4 and 5", [1, 1, 1]),            # a list, not a thousands separator
    ("12,3456", [2, 1, 4, 3, 2, 1]),      # four digits after the comma: two numbers
    ("1,234,5678", [4, 3, 2, 1, 4, 3, 2, 1]),
    ("0.1,234", [1, -1, 3, 2, 1]),        # a comma after a fraction digit separates nothing
]


def digit_places(text: str) -> list[int]:
    return [p for c, p in zip(text, run_places(list(text))) if c.isdigit()]


@pytest.mark.parametrize("text,places", CASES, ids=[c[0] for c in CASES])
def test_run_places_join_thousands_separators_as_the_scorer_reads_them(text, places):
    assert digit_places(text) == places


@pytest.mark.parametrize("text", ["1,234", "$1,234.50", "1,000,000"])
def test_the_scorer_and_the_run_rule_agree(text):
    value = parse_number(text)
    assert sorted(digits_by_place(value), reverse=True) == digit_places(text)


def test_number_tokens_and_the_loss_weights_follow_the_same_rule(llama3_tokenizer, llama3_vocab):
    text = "The total is $1,234.50 and 3,4 more."
    for tok, vocab in ((build_tokenizer(), None), (llama3_tokenizer, llama3_vocab)):
        vocab = vocab or NumberVocab.from_tokenizer(tok)
        ids = tok.encode(text, add_special_tokens=False)
        per_char = [p for t in vocab.places(ids) for p in t if p is not None]
        assert per_char == [4, 3, 2, 1, -1, -2, 1, 1], tok
        weights = number_targets(torch.tensor([ids]), vocab).weights.tolist()
        assert weights == pytest.approx([place_weight(p) for p in per_char])


def test_inspect_reads_the_same_places():
    from delft.inspection.records import label_positions

    tok = build_tokenizer()
    vocab = NumberVocab.from_tokenizer(tok)
    ids = tok.encode("$1,234.50", add_special_tokens=False)
    texts = [tok.decode([i]) for i in ids]
    kind, number, place = label_positions(ids, texts, vocab)
    assert [p for k, p in zip(kind, place) if k == "digit"] == [4, 3, 2, 1, -1, -2]
    assert len({n for n in number if n is not None}) == 1  # one number, not "1" and "234.50"
