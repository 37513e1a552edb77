"""data.columns (issue 52 item 5): a file whose columns are question/answer (or any other names) trains as
prompt_completion through a mapping key, as axolotl's field_* and LLaMA-Factory's columns do; a mapping to a column
the file lacks, or from a field the format does not read, is one paragraph. Real files, the real loader and CLI."""

from __future__ import annotations

import json

from helpers import recipe_file, run_cli

from delft.data.pipeline import load_examples
from delft.recipe.schema import DataConfig

ROWS = [{"question": "2 + 3 =", "answer": "5", "gold": 5}, {"question": "40 + 2 =", "answer": 42, "gold": "42"}]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def paragraph(output: str) -> str:
    return " ".join(output[output.index("error:"):].split())


def test_question_and_answer_columns_read_as_prompt_and_completion(tmp_path):
    path = write_rows(tmp_path / "qa.jsonl", ROWS)
    cfg = DataConfig(source=str(path), format="prompt_completion",
                     columns={"prompt": "question", "completion": "answer", "answer": "gold"})
    got = [(e.prompt, e.completion, e.answer) for e in load_examples(cfg)]
    assert got == [("2 + 3 =", "5", "5"), ("40 + 2 =", "42", "42")]
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\n7 + 1 =,8\n")
    cfg = DataConfig(source=str(csv), format="prompt_completion",
                     columns={"prompt": "question", "completion": "answer"})
    assert [(e.prompt, e.completion) for e in load_examples(cfg)] == [("7 + 1 =", "8")]


def test_a_mapped_column_wins_over_a_column_of_the_fields_own_name(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": "ignored", "q": "1 + 1 =", "completion": "2"}])
    cfg = DataConfig(source=str(path), format="prompt_completion", columns={"prompt": "q"})
    assert load_examples(cfg)[0].prompt == "1 + 1 ="


def test_a_column_the_file_lacks_is_refused_with_the_files_columns(tmp_path, tiny_model_dir):
    path = write_rows(tmp_path / "qa.jsonl", ROWS)
    rec = recipe_file(tmp_path, tiny_model_dir, data={"source": str(path), "format": "prompt_completion",
                                                      "columns": {"prompt": "questoin", "completion": "answer"}})
    r = run_cli("recipe", "check", rec)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    text = paragraph(r.output)
    assert "'questoin'" in text and "question, answer, gold" in text and "data.columns" in text, r.output


def test_a_bad_value_is_named_by_the_column_the_user_wrote(tmp_path):
    path = write_rows(tmp_path / "qa.jsonl", [{"question": ["not", "text"], "answer": "5"}])
    cfg = DataConfig(source=str(path), format="prompt_completion",
                     columns={"prompt": "question", "completion": "answer"})
    try:
        load_examples(cfg)
    except Exception as e:  # delft.errors.UserError
        assert "'question'" in str(e) and "'prompt'" not in str(e), str(e)
    else:
        raise AssertionError("a list prompt was read as text")


def test_columns_for_a_field_the_format_does_not_read_or_a_generated_source_are_refused(tmp_path, tiny_model_dir):
    path = write_rows(tmp_path / "qa.jsonl", ROWS)
    rec = recipe_file(tmp_path, tiny_model_dir, data={"source": str(path), "format": "prompt_completion",
                                                      "columns": {"question": "prompt"}})
    r = run_cli("recipe", "check", rec)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "'question'" in paragraph(r.output) and "prompt, completion, answer" in paragraph(r.output), r.output
    rec = recipe_file(tmp_path, tiny_model_dir, name="gen", data={"columns": {"prompt": "q"}})
    r = run_cli("recipe", "check", rec)
    assert r.exit_code == 2 and "generates its examples" in paragraph(r.output), r.output
