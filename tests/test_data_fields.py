"""Data fields are text or a refusal (issue 36, items 5-7): a prompt that is a list, a completion that is an object,
booleans, NaN / Infinity / 1e999999, a 10,000-digit integer, a 100,000-deep value, bytes and list columns in
parquet, wrong-typed alpaca / gsm8k / svamp / chat fields, broken CSV rows, an empty parquet table and a data path
that is a device, a pipe or a dangling symlink. Each used to train (exit 0) on text like "{'a': 1}" or "nan", end
in a traceback, or say "does not exist"; now each is one paragraph naming file, row and field, exit 2, before any
model loads.

Real files through the real CLI: `delft train RECIPE` (and `delft eval --data FILE`) in process on the tiny model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import recipe_file, run_cli

from delft.data.pipeline import load_examples
from delft.recipe.schema import DataConfig

GOOD = {"prompt_completion": {"prompt": "1 + 1 =", "completion": "2"},
        "alpaca": {"instruction": "Add 1 and 1.", "input": "", "output": "2"},
        "gsm8k": {"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
        "svamp": {"Body": "Tom has 1 apple.", "Question": "He gets 1 more: how many?", "Answer": 2.0},
        "chat": {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}}
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 10_000


def jsonl(fmt: str, bad: str) -> str:
    """A good row, then ``bad`` (JSON text of the second record, as written: NaN and the like stay raw)."""
    return json.dumps(GOOD[fmt]) + "\n" + bad + "\n"


def raw(fmt: str, **fields) -> str:
    """The second row: the good record with ``fields`` replaced by raw JSON text."""
    parts = {k: json.dumps(v) for k, v in GOOD[fmt].items()}
    parts.update(fields)
    return "{" + ", ".join(f'"{k}": {v}' for k, v in parts.items()) + "}"


# name: (file name, format, file content, words the one paragraph must hold)
CASES = {
    "prompt a list": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", prompt='["a", "b"]')), ["d.jsonl row 2", "field 'prompt'", "is a list (['a', 'b'])"]),
    "prompt a number": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", prompt="5")), ["d.jsonl row 2", "field 'prompt'", "is a number (5)"]),
    "completion an object": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", completion='{"a": 1}')), ["row 2", "field 'completion'", "is an object ({'a': 1})"]),
    "prompt a boolean": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", prompt="true")), ["row 2", "field 'prompt'", "true/false (True)"]),
    "completion a boolean": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", completion="false")), ["row 2", "field 'completion'", "true/false (False)"]),
    "completion NaN": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", completion="NaN")), ["row 2", "field 'completion'", "JSON number NaN", "finite"]),
    "answer -Infinity": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", answer="-Infinity")), ["row 2", "field 'answer'", "JSON number -Infinity"]),
    "completion 1e999999": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", completion="1e999999")), ["row 2", "field 'completion'", "JSON number 1e999999"]),
    "answer a list": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", answer='["12"]')), ["row 2", "field 'answer'", "is a list"]),
    "answer of 10,000 digits": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", answer=HUGE_INT)), ["row 2", "field 'answer'", "integer of 10000 digits"]),
    "a 100,000-deep value in a .jsonl": ("d.jsonl", "prompt_completion", jsonl("prompt_completion", raw(
        "prompt_completion", prompt=DEEP)), ["d.jsonl row 2", "levels deep", "deeper than Python's JSON reader goes"]),
    "a 100,000-deep value in a .json": ("d.json", "prompt_completion", "[" + json.dumps(GOOD["prompt_completion"])
                                        + ",\n" + raw("prompt_completion", prompt=DEEP) + "]",
                                        ["d.json item 2 (line 2)", "levels deep"]),
    "completion NaN in a .json list": ("d.json", "prompt_completion", "[" + json.dumps(GOOD["prompt_completion"])
                                       + ", " + raw("prompt_completion", completion="NaN") + "]",
                                       ["d.json row 2", "field 'completion'", "JSON number NaN"]),
    "alpaca instruction a list": ("d.jsonl", "alpaca", jsonl("alpaca", raw("alpaca", instruction='["add"]')),
                                  ["row 2", "field 'instruction'", "is a list"]),
    "alpaca output an object": ("d.jsonl", "alpaca", jsonl("alpaca", raw("alpaca", output='{"sum": 2}')),
                                ["row 2", "field 'output'", "is an object"]),
    "alpaca input a number": ("d.jsonl", "alpaca", jsonl("alpaca", raw("alpaca", input="3")),
                              ["row 2", "field 'input'", "is a number (3)"]),
    "gsm8k question a list": ("d.jsonl", "gsm8k", jsonl("gsm8k", raw("gsm8k", question='["q"]')),
                              ["row 2", "field 'question'", "is a list"]),
    "gsm8k answer a number": ("d.jsonl", "gsm8k", jsonl("gsm8k", raw("gsm8k", answer="2")),
                              ["row 2", "field 'answer'", "is a number (2)"]),
    "svamp Answer not a number": ("d.json", "svamp", "[" + json.dumps(GOOD["svamp"]) + ", "
                                  + raw("svamp", Answer='"two"') + "]", ["row 2", "field 'Answer'", "'two'",
                                                                          "not a number"]),
    "svamp Answer a boolean": ("d.json", "svamp", "[" + json.dumps(GOOD["svamp"]) + ", " + raw("svamp", Answer="true")
                               + "]", ["row 2", "field 'Answer'", "true/false"]),
    "svamp Answer NaN": ("d.json", "svamp", "[" + json.dumps(GOOD["svamp"]) + ", " + raw("svamp", Answer="NaN")
                         + "]", ["row 2", "field 'Answer'", "JSON number NaN"]),
    "svamp Body a list": ("d.json", "svamp", "[" + json.dumps(GOOD["svamp"]) + ", " + raw("svamp", Body='["x"]')
                          + "]", ["row 2", "field 'Body'", "is a list"]),
    "chat content a list": ("d.jsonl", "chat", jsonl("chat", raw("chat", messages=json.dumps(
        [{"role": "user", "content": [{"type": "text", "text": "1 + 1?"}]}, {"role": "assistant", "content": "2"}]))),
        ["row 2", "field 'messages[0].content'", "is a list"]),
    "chat role a number": ("d.jsonl", "chat", jsonl("chat", raw("chat", messages=json.dumps(
        [{"role": 1, "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]))),
        ["row 2", "field 'messages[0].role'", "is a number (1)"]),
    "csv row with an extra field": ("d.csv", "prompt_completion", "prompt,completion\n1 + 1 =,2\n2, 2 =,4\n",
                                    ["d.csv row 2 (line 3) has 3 fields, the header 2 (prompt, completion)"]),
    "csv row with a field missing": ("d.csv", "prompt_completion", "prompt,completion\n1 + 1 =,2\n2 + 2 =\n",
                                     ["d.csv row 2 (line 3) has 1 field, the header 2"]),
    "csv quote never closed": ("d.csv", "prompt_completion", 'prompt,completion\n1 + 1 =,2\n"2 + 2 =,4\n3 + 3 =,6\n',
                               ["d.csv row 2 (from line 3) is not valid CSV", "close every quote"]),
    "csv text after a closing quote": ("d.csv", "prompt_completion", 'prompt,completion\n1 + 1 =,2\n"2 + 2" =,4\n',
                                       ["d.csv row 2 (from line 3) is not valid CSV"]),
}

PARQUET = {  # name: (columns, words)
    "parquet bytes prompt": ({"prompt": [b"1 + 1 =", b"2 + 2 ="], "completion": ["2", "4"]},
                             ["d.parquet row 1", "field 'prompt'", "is bytes (b'1 + 1 =')"]),
    "parquet list completion": ({"prompt": ["1 + 1 =", "2 + 2 ="], "completion": [["2"], ["4"]]},
                                ["d.parquet row 1", "field 'completion'", "is a list (['2'])"]),
    "parquet NaN completion": ({"prompt": ["1 + 1 =", "2 + 2 ="], "completion": [2.0, float("nan")]},
                               ["d.parquet row 2", "field 'completion'", "is a number (nan)"]),
    "parquet with 0 rows": ({"prompt": [], "completion": []},
                            ["d.parquet is a parquet table with 0 rows (columns: prompt, completion)"]),
}


def train_on(tmp_path: Path, model: Path, data: Path, fmt: str):
    rec = recipe_file(tmp_path, model, data={"source": str(data), "format": fmt, "val_size": 0})
    return run_cli("train", rec)


def refused_before_training(r, run_dir: Path, *words: str) -> str:
    """Exit 2, one paragraph holding every one of ``words``, no traceback, and no run directory made."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, (SystemExit, type(None))), r.output
    assert not run_dir.exists(), sorted(os.listdir(run_dir))
    paragraph = r.output[r.output.index("error:"):].strip()
    assert "\n" not in paragraph, r.output  # one paragraph: the CLI prints it as one soft-wrapped line
    for w in ("data.source", *words):
        assert w in paragraph, (w, r.output)
    return paragraph


@pytest.mark.parametrize("case", list(CASES))
def test_a_field_that_is_not_text_is_refused_by_file_row_and_field(case, tmp_path, tiny_model_dir):
    name, fmt, content, words = CASES[case]
    path = tmp_path / name
    path.write_text(content)
    refused_before_training(train_on(tmp_path, tiny_model_dir, path, fmt), tmp_path / "run", *words)


@pytest.mark.parametrize("case", list(PARQUET))
def test_a_parquet_column_that_is_not_text_or_a_table_without_rows_is_refused(case, tmp_path, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns, words = PARQUET[case]
    schema = None if any(columns.values()) else pa.schema([("prompt", pa.string()), ("completion", pa.string())])
    pq.write_table(pa.table(columns, schema=schema), tmp_path / "d.parquet")
    refused_before_training(train_on(tmp_path, tiny_model_dir, tmp_path / "d.parquet", "prompt_completion"),
                            tmp_path / "run", *words)


def fifo(path: Path) -> None:
    os.mkfifo(path)


PATHS = {  # name: (make the data path, words)
    "a symlink to /dev/zero": (lambda p: p.symlink_to("/dev/zero"),
                               ["is a character device (a symlink to /dev/zero), not a regular file"]),
    "a named pipe": (fifo, ["is a named pipe (FIFO), not a regular file"]),
    "a dangling symlink": (lambda p: p.symlink_to(p.parent / "gone.jsonl"),
                           ["is a symlink to", "gone.jsonl, which does not exist"]),
}


@pytest.mark.parametrize("case", list(PATHS))
def test_a_data_path_that_is_no_regular_file_is_named_for_what_it_is(case, tmp_path, tiny_model_dir):
    """Used to say "does not exist" for a device, or to block forever reading a pipe."""
    make, words = PATHS[case]
    path = tmp_path / "d.jsonl"
    make(path)
    refused_before_training(train_on(tmp_path, tiny_model_dir, path, "prompt_completion"), tmp_path / "run",
                            "d.jsonl", *words)


EVAL_CASES = ["completion NaN", "answer of 10,000 digits", "a 100,000-deep value in a .json", "svamp Answer NaN",
              "csv quote never closed"]


@pytest.mark.parametrize("case", EVAL_CASES)
def test_eval_data_goes_through_the_same_checks(case, tmp_path, tiny_model_dir):
    """`delft eval --data FILE` (and so study eval sets, which load_problems reads alike) refuses the same rows."""
    name, fmt, content, words = CASES[case]
    path = tmp_path / name
    path.write_text(content)
    r = run_cli("eval", "--model", tiny_model_dir, "--data", path, "--format", fmt, "--set", "eval.max_new_tokens=2")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    paragraph = " ".join(r.output[r.output.index("error:"):].split())
    assert "eval.data.source" in paragraph and all(w in paragraph for w in words), r.output
    assert "delft eval:" not in r.output  # refused before the title, before any model answered


# ----------------------------------------------------------------------------- the good side


NUMERIC = [{"prompt": "6 * 7 =", "completion": 42, "answer": 42}, {"prompt": "5 / 2 =", "completion": 2.5},
           {"prompt": "10 ** 20 =", "completion": 1e20, "answer": 100000000000000000000},
           {"prompt": "2 - 2 =", "completion": 0.0, "answer": -0.0}, {"prompt": "1 / 4 =", "completion": "0.25"}]


def test_finite_numeric_answers_are_read_as_their_plain_text(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in NUMERIC))
    got = load_examples(DataConfig(source=str(path), format="prompt_completion"))
    assert [(e.prompt, e.completion, e.answer) for e in got] == [
        ("6 * 7 =", "42", "42"), ("5 / 2 =", "2.5", None), ("10 ** 20 =", "100000000000000000000",
                                                            "100000000000000000000"),
        ("2 - 2 =", "0", "0"), ("1 / 4 =", "0.25", None)]
    svamp = tmp_path / "s.json"
    svamp.write_text(json.dumps([{**GOOD["svamp"], "Answer": a} for a in (51, 2.5, "51", "1,024", 7.0)]))
    assert [e.answer for e in load_examples(DataConfig(source=str(svamp), format="svamp"))] == [
        "51", "2.5", "51", "1024", "7"]
    alpaca = tmp_path / "a.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Add 40 and 2.", "output": 42}) + "\n")
    assert load_examples(DataConfig(source=str(alpaca), format="alpaca"))[0].completion == "42"


def test_csv_cells_stay_the_text_written_and_a_quoted_comma_is_one_field(tmp_path):
    """The strict CSV reader keeps "2.50" and "007" as written (no float inference) and reads a pandas index
    column (an empty header name) as an unused column."""
    path = tmp_path / "d.csv"
    path.write_text(',prompt,completion,answer\n0,"1,000 + 1 =","1,001",1001\n1,2.5 * 1 =,2.50,\n2,007 =,007,7\n')
    got = load_examples(DataConfig(source=str(path), format="prompt_completion"))
    assert [(e.prompt, e.completion, e.answer) for e in got] == [
        ("1,000 + 1 =", "1,001", "1001"), ("2.5 * 1 =", "2.50", None), ("007 =", "007", "7")]


def test_numeric_completions_train(tmp_path, tiny_model_dir):
    """A file of JSON numbers as completions still trains to the end (exit 0)."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "completion": i + 1}) + "\n" for i in range(16)))
    rec = recipe_file(tmp_path, tiny_model_dir, data={"source": str(path), "format": "prompt_completion",
                                                      "val_size": 4}, train={"max_steps": 2, "eval_steps": 2})
    r = run_cli("train", rec)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


def test_a_study_data_file_that_is_a_device_is_named_for_what_it_is(tmp_path):
    """delft study checks its data files before training any arm: a device there said "does not exist"."""
    from delft.errors import UserError
    from delft.experiments.study_file import data_file

    (tmp_path / "gsm8k_test.jsonl").symlink_to("/dev/zero")
    with pytest.raises(UserError) as e:
        data_file("gsm8k_test.jsonl", tmp_path, "evals.held_out.source")
    assert "evals.held_out.source" in str(e.value) and "is a character device" in str(e.value)
