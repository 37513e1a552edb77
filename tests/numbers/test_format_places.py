"""Places follow the value under every data.numbers form (issue 40): the token view the losses, the teacher-forced
metrics, the preview and inspect read (NumberVocab.written_as), against the character view of
delft.numbers.formats.written_places and hand-worked cases; a count prefix's counts are their own small number."""

import random

import pytest
from tiny import build_model, build_tokenizer

from delft.data.sources import Example
from delft.evaluation.teacher_forced import teacher_forced
from delft.inspection.records import label_positions
from delft.numbers.digits import place_weight, run_places
from delft.numbers.formats import prefix_characters, write_numbers, written_places
from delft.numbers.tokens import NumberVocab, number_targets
from delft.recipe.schema import DataConfig, NumbersConfig

FORMS = [("natural", False), ("reversed", False), ("natural", True), ("reversed", True)]


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_tokenizer(chat_template=False)


def vocab_for(tokenizer, order="natural", prefix=False) -> NumberVocab:
    return NumberVocab.from_tokenizer(tokenizer).written_as(NumbersConfig(order=order, count_prefix=prefix))


def flat(places) -> list:
    """Per character of a character-tokenized text: its place (None for anything but a digit of a number)."""
    return [p[0] if p else None for p in places]


def random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 4)):
        n = str(rng.randint(0, 10 ** rng.randint(1, 12)))
        if rng.random() < 0.3:
            n += "." + str(rng.randint(1, 999))
        if rng.random() < 0.2 and len(n) > 4 and "." not in n:
            n = f"{int(n):,}"
        pieces.append(rng.choice(["", "-", "x", "$"]) + n + rng.choice([" ", " and ", "; ", "\n"]))
    return "".join(pieces)


@pytest.mark.parametrize("order,prefix", FORMS)
def test_token_places_are_the_true_places_of_the_written_text(char_tokenizer, order, prefix):
    vocab = vocab_for(char_tokenizer, order, prefix)
    rng = random.Random(0)
    for _ in range(300):
        written = write_numbers(random_text(rng), order, prefix)
        ids = char_tokenizer.encode(written, add_special_tokens=False)
        assert len(ids) == len(written)
        got = flat(vocab.places(ids))
        want = written_places(written, order, prefix)
        counts = prefix_characters(written, order, prefix) if prefix else [False] * len(written)
        for i, (g, w, is_count) in enumerate(zip(got, want, counts)):
            if not is_count:
                assert g == w, (written, i)
        if prefix:  # every count is its own natural number: '12' in {12:...} gets places 2, 1
            count_places = run_places([c if is_count and c in "0123456789." else None
                                       for c, is_count in zip(written, counts)])
            assert [g for g, c in zip(got, counts) if c] == [p for p, c in zip(count_places, counts) if c]


def test_hand_worked_places_under_each_form(char_tokenizer):
    cases = {("reversed", False, "-5.4321"): [None, -1, None, 1, 2, 3, 4],   # -1234.5
             ("reversed", False, "765,432,1"): [1, 2, 3, None, 4, 5, 6, None, 7],  # 1,234,567
             ("reversed", True, "{2:24}"): [None, 1, None, 1, 2, None],  # 42: the count 2 is its own number
             ("reversed", True, "{4.1:5.4321}"): [None, 1, None, -1, None, -1, None, 1, 2, 3, 4, None],
             ("natural", True, "{12:123456789012}"): [None, 2, 1, None] + list(range(12, 0, -1)) + [None]}
    for (order, prefix, text), want in cases.items():
        ids = char_tokenizer.encode(text, add_special_tokens=False)
        assert flat(vocab_for(char_tokenizer, order, prefix).places(ids)) == want, text


def test_del_weighs_a_reversed_digit_by_its_value(char_tokenizer):
    """42 reversed is '24': its first digit is the units (DEL weight of place 1), its second the tens."""
    import torch

    ids = torch.tensor([char_tokenizer.encode("24", add_special_tokens=False)])
    natural = number_targets(ids, vocab_for(char_tokenizer), place_weight).weights.tolist()
    reverse = number_targets(ids, vocab_for(char_tokenizer, "reversed"), place_weight).weights.tolist()
    assert natural == [place_weight(2), place_weight(1)] and reverse == [place_weight(1), place_weight(2)]
    assert place_weight(1) != place_weight(2)


def test_inspect_labels_the_units_digit_of_a_reversed_answer_first(char_tokenizer):
    ids = char_tokenizer.encode("713", add_special_tokens=False)  # 317 reversed
    texts = [char_tokenizer.decode([i]) for i in ids]
    kind, number, place = label_positions(ids, texts, vocab_for(char_tokenizer, "reversed"))
    assert kind == ["digit"] * 3 and number == [0, 0, 0] and place == [1, 2, 3]
    assert label_positions(ids, texts, vocab_for(char_tokenizer))[2] == [3, 2, 1]


def test_teacher_forced_places_of_a_reversed_run(char_tokenizer):
    model = build_model(char_tokenizer).eval()
    vocab = NumberVocab.from_tokenizer(char_tokenizer)
    examples = [Example("12+305=", "317", "317", 0)]
    reverse = DataConfig(source="x.jsonl", format="prompt_completion", template="plain",
                         numbers={"order": "reversed", "scope": "answer"})
    natural = reverse.model_copy(update={"numbers": NumbersConfig()})
    got = [p.place for p in teacher_forced(model, char_tokenizer, examples, reverse, vocab, 4).positions]
    want = [p.place for p in teacher_forced(model, char_tokenizer, examples, natural, vocab, 4).positions]
    assert got[:3] == [1, 2, 3] and want[:3] == [3, 2, 1]  # '713' teacher-forced, read as 317


@pytest.mark.parametrize("order,prefix", FORMS[1:])
def test_number_tokens_of_two_digits_get_the_same_true_places(order, prefix):
    """Llama-3-style number tokens ('12', '34'): runs cross tokens, and each digit character still gets the place
    written_places gives it."""
    tok = build_tokenizer(chunked_digits=True, chat_template=False)
    vocab = vocab_for(tok, order, prefix)
    rng = random.Random(1)
    for _ in range(200):
        written = write_numbers(random_text(rng), order, prefix)
        ids = tok.encode(written, add_special_tokens=False)
        got = [p for i, places in zip(ids, vocab.places(ids)) for p in (places or [None] * len(tok.decode([i])))]
        counts = prefix_characters(written, order, prefix) if prefix else [False] * len(written)
        assert len(got) == len(written) and max(len(vocab.text_of(i) or "") for i in ids) <= 2
        assert [g for g, c in zip(got, counts) if not c] == \
            [w for w, c in zip(written_places(written, order, prefix), counts) if not c]
