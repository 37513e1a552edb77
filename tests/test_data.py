import json
from decimal import Decimal

import pytest
from helpers import DATA

from delft.numbers.tokens import IGNORE
from delft.data.pipeline import build_datasets, load_examples
from delft.data.batches import collate, collate_packed, tokenize_example
from delft.data.sources import format_number
from delft.data.prompts import render_pair
from delft.data.generated import synthetic_examples
from delft.errors import UserError
from delft.recipe.schema import DataConfig, SyntheticConfig


def cfg(**kw) -> DataConfig:
    return DataConfig(**kw)


def jsonl(tmp_path, rows, name="d.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_is_seeded_and_exact():
    c = SyntheticConfig(n=300, seed=5)
    a, b = synthetic_examples(c), synthetic_examples(c)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert synthetic_examples(SyntheticConfig(n=300, seed=6))[0].prompt != a[0].prompt or \
        synthetic_examples(SyntheticConfig(n=300, seed=6))[1].prompt != a[1].prompt
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x / y}
    seen_ops, negatives, decimals = set(), 0, 0
    for e in a:
        _, x, op, y = e.prompt.rstrip("?").split(" ", 1)[1].rpartition(" ")[0], *e.prompt[8:-1].split(" ")
        x, y = Decimal(x), Decimal(y)
        assert Decimal(e.answer) == ops[op](x, y), e.prompt
        assert e.completion == e.answer
        seen_ops.add(op)
        negatives += e.answer.startswith("-")
        decimals += "." in e.answer
    assert seen_ops == {"+", "-", "*", "/"} and negatives > 0 and decimals > 0


def test_synthetic_digit_counts_are_respected():
    for e in synthetic_examples(SyntheticConfig(n=100, min_digits=4, max_digits=4, ops=["+"], decimal_fraction=0,
                                                negative_fraction=0)):
        x, _, y = e.prompt[8:-1].split(" ")
        assert len(x) == 4 and len(y) == 4


def test_synthetic_long_operands_are_exact():
    # 30-digit operands overflow Decimal's default 28-digit precision: sums and differences must stay exact.
    cfg = SyntheticConfig(n=60, min_digits=30, max_digits=30, ops=["+", "-"], decimal_fraction=0.5,
                          negative_fraction=0.3)
    for e in synthetic_examples(cfg):
        x, op, y = e.prompt.removeprefix("What is ").rstrip("?").split(" ")
        assert len(x.lstrip("-").partition(".")[0]) == 30 and len(y.lstrip("-").partition(".")[0]) == 30
        assert _hundredths(e.answer) == _hundredths(x) + (1 if op == "+" else -1) * _hundredths(y)


def _hundredths(text: str) -> int:
    """A number of at most 2 decimals, times 100, by string (Decimal arithmetic would round past 28 digits)."""
    integer, _, fraction = text.partition(".")
    value = int(integer.lstrip("-") + fraction.ljust(2, "0"))
    return -value if text.startswith("-") else value


def test_synthetic_copy_repeats_the_number():
    examples = synthetic_examples(SyntheticConfig(n=40, ops=["copy"], min_digits=20, max_digits=25))
    for e in examples:
        number = e.prompt.removeprefix("Repeat ")
        assert e.prompt.startswith("Repeat ") and e.answer == e.completion == number
        assert 20 <= len(number.lstrip("-").partition(".")[0]) <= 25
    mixed = synthetic_examples(SyntheticConfig(n=200, ops=["+", "copy"], seed=3))
    assert {e.prompt.split(" ")[0] for e in mixed} == {"What", "Repeat"}


def test_format_number():
    assert [format_number(Decimal(s)) for s in ["1.50", "-0", "100", "2E+2", "0.000"]] == ["1.5", "0", "100", "200", "0"]


# ----------------------------------------------------------------------------- formats


def test_prompt_completion_and_masking(tmp_path, tiny_tokenizer):
    src = jsonl(tmp_path, [{"prompt": "What is 2+2?", "completion": "4"}])
    c = cfg(source=src, format="prompt_completion", template="plain")
    (ex,) = load_examples(c)
    tok = tokenize_example(ex, tiny_tokenizer, c)
    n_prompt = len(tiny_tokenizer.encode("What is 2+2?", add_special_tokens=False))  # joined as written
    assert tok.labels[:n_prompt] == [IGNORE] * n_prompt
    assert tok.labels[n_prompt:] == tok.input_ids[n_prompt:]
    assert tiny_tokenizer.decode(tok.input_ids[n_prompt:]) == "4</s>"


def test_train_on_prompt_keeps_all_labels(tmp_path, tiny_tokenizer):
    src = jsonl(tmp_path, [{"prompt": "Q", "completion": "7"}])
    c = cfg(source=src, format="prompt_completion", train_on_prompt=True)
    tok = tokenize_example(load_examples(c)[0], tiny_tokenizer, c)
    assert tok.labels == tok.input_ids


def test_chat_template_masks_everything_but_the_answer(tmp_path, tiny_tokenizer):
    src = jsonl(tmp_path, [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}])
    c = cfg(source=src, format="chat")
    ex = load_examples(c)[0]
    prompt, completion = render_pair(ex, tiny_tokenizer, c)
    assert prompt == "<|user|>1+1?</s>\n<|assistant|>" and completion == "2</s>\n"
    tok = tokenize_example(ex, tiny_tokenizer, c)
    trained = [t for t, lab in zip(tok.input_ids, tok.labels) if lab != IGNORE]
    assert tiny_tokenizer.decode(trained) == "2</s>\n"


def test_alpaca_json_list(tmp_path, tiny_tokenizer):
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"instruction": "Add", "input": "2 and 3", "output": "5"},
                             {"instruction": "Say seven", "output": "7"}]))
    c = cfg(source=str(p), format="alpaca", template="plain")
    a, b = load_examples(c)
    assert "### Input:\n2 and 3" in a.prompt and a.completion == "5"
    assert "### Input" not in b.prompt and b.prompt.endswith("### Response:\n")


def test_csv_and_parquet(tmp_path):
    import datasets

    rows = [{"prompt": "p1", "completion": "1"}, {"prompt": "p2", "completion": "2"}]
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.csv", "d.parquet"):
        got = load_examples(cfg(source=str(tmp_path / name), format="prompt_completion"))
        assert [(e.prompt, e.completion) for e in got] == [("p1", "1"), ("p2", "2")]


def test_gsm8k_real_slice():
    c = cfg(source=str(DATA / "gsm8k_test.jsonl"), format="gsm8k", limit=5)
    exs = load_examples(c)
    assert len(exs) == 5  # of the file's 6 rows
    assert exs[0].answer == "18" and "<<" not in exs[0].completion and exs[0].completion.endswith("#### 18")


def test_svamp_real_slice():
    exs = load_examples(cfg(source=str(DATA / "svamp.json"), format="svamp", limit=3))
    assert len(exs) == 3  # of the file's 4 rows
    assert exs[0].prompt.startswith("Each pack of dvds costs 76 dollars.") and exs[0].prompt.endswith("each pack?")
    assert exs[0].answer == "51"


# ----------------------------------------------------------------------------- errors name file, row, field


def test_missing_column_names_file_row_field(tmp_path):
    src = jsonl(tmp_path, [{"prompt": "a", "completion": "1"}, {"prompt": "b", "answer": "2"}])
    with pytest.raises(UserError) as e:
        load_examples(cfg(source=src, format="prompt_completion"))
    msg = str(e.value)
    assert "d.jsonl row 2" in msg and "'completion'" in msg


def test_bad_json_row(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "completion": "1"}\n{"prompt": oops}\n')
    with pytest.raises(UserError, match="d.jsonl row 2 is not valid JSON"):
        load_examples(cfg(source=str(p), format="prompt_completion"))


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(UserError, match="is empty"):
        load_examples(cfg(source=str(tmp_path / "e.jsonl"), format="prompt_completion"))
    with pytest.raises(UserError, match="does not exist"):
        load_examples(cfg(source=str(tmp_path / "nope.jsonl"), format="prompt_completion"))


def test_gsm8k_without_final_answer(tmp_path):
    src = jsonl(tmp_path, [{"question": "q", "answer": "no marker"}])
    with pytest.raises(UserError, match="row 1: 'answer' does not end with '#### NUMBER'"):
        load_examples(cfg(source=src, format="gsm8k"))


def test_all_masked_dataset_is_refused(tmp_path, tiny_tokenizer):
    src = jsonl(tmp_path, [{"prompt": "x" * 100, "completion": "1"}] * 3)
    with pytest.raises(UserError, match="all its labels masked"):
        build_datasets(cfg(source=src, format="prompt_completion", max_length=20), tiny_tokenizer, seed=0)


def test_counts_and_split(tiny_tokenizer):
    from delft.numbers.tokens import NumberVocab

    vocab = NumberVocab.from_tokenizer(tiny_tokenizer)
    train, val, stats = build_datasets(cfg(synthetic=SyntheticConfig(n=40), val_size=0.25), tiny_tokenizer, 0,
                                       set(vocab.digit_ids))
    assert (stats.train, stats.val) == (30, 10)
    assert stats.label_tokens == sum(sum(1 for x in t.labels if x != IGNORE) for t in train + val)
    assert 0 < stats.digit_labels < stats.label_tokens


# ----------------------------------------------------------------------------- batches and packing


def test_collate_pads_right_and_masks_padding(tiny_tokenizer):
    from delft.data.batches import Tokenized

    b = collate([Tokenized([5, 6, 7], [IGNORE, 6, 7]), Tokenized([8], [8])], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_packing_matches_unpacked_logits(tiny_model_dir, tiny_tokenizer):
    """Packed rows must give every example the logits it gets alone (no attention across examples)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    c = cfg(synthetic=SyntheticConfig(n=5), template="plain")
    items = [tokenize_example(e, tiny_tokenizer, c) for e in load_examples(c)]
    packed = collate_packed(items, tiny_tokenizer.pad_token_id, row_length=256)
    assert packed["input_ids"].shape[0] == 1
    with torch.no_grad():
        # use_cache=False: transformers only builds the packed (block-diagonal) mask without a cache
        out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        at = 0
        for t in items:
            alone = model(input_ids=torch.tensor([t.input_ids])).logits[0]
            n = len(t.input_ids)
            torch.testing.assert_close(out[at:at + n], alone, atol=1e-5, rtol=1e-4)
            assert packed["labels"][0, at].item() == IGNORE  # no target crosses a boundary
            at += n
