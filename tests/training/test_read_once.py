"""A `delft train` reads its data file once and checks its model folder once; a held-out slice that is the
training data is refused by `delft recipe check` and `delft train` alike, in the same words.

Reads are counted where they happen: every open() of a data file for reading, whoever makes it, through an audit
hook (sys.addaudithook: builtins.open and os.open both report it), and every call of the model folder's checks
through a counter that calls the real function, put wherever a delft module holds it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import recipe_file, refused, run_cli

from delft.data import pipeline
from delft.data.pipeline import load_examples
from delft.models import context, loading
from delft.recipe.files import load_recipe

OPENS: dict[str, int] = {}  # resolved path -> opens seen since a test began watching it


def _count_open(event: str, args: tuple) -> None:
    """Counts an open for reading of a watched path (args: path, mode (builtins.open) or None (os.open), flags)."""
    if event != "open" or not OPENS or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    mode, flags = args[1], args[2]
    if any(c in mode for c in "wax+") if isinstance(mode, str) else flags & (os.O_WRONLY | os.O_RDWR):
        return  # the test writing its file
    path = os.fsdecode(args[0])
    if os.path.basename(path) in {os.path.basename(p) for p in OPENS}:
        real = os.path.realpath(path)
        if real in OPENS:
            OPENS[real] += 1


sys.addaudithook(_count_open)  # a hook stays for the process: it counts only while a test watches a path


@pytest.fixture
def opens():
    """``watch(path)`` starts counting the opens of ``path``; ``opens[path]`` is the count so far."""
    class Opens:
        def watch(self, *paths: Path) -> None:
            for p in paths:
                OPENS[os.path.realpath(p)] = 0

        def __getitem__(self, path: Path) -> int:
            return OPENS[os.path.realpath(path)]

    yield Opens()
    OPENS.clear()


def calls_of(monkeypatch, module, name: str) -> list:
    """Every call of ``module.name`` from here on, the real function run each time: the counter replaces it in
    every delft module that imported it, so a call from anywhere is seen."""
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("delft") and getattr(mod, name, None) is real:
            monkeypatch.setattr(mod, name, counted)
    return calls


def sums(path: Path, pairs) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "completion": str(a + b)}) + "\n"
                            for a, b in pairs))
    return path


TRAIN_PAIRS = [(a, b) for a in range(1, 7) for b in range(1, 5)]  # 24 problems
FAST = {"max_steps": 2, "batch_size": 4, "logging_steps": 1, "eval_steps": 2, "save_steps": 10,
        "accuracy_steps": 2, "accuracy_examples": 4}


def file_recipe(tmp_path: Path, model_dir: Path, train_file: Path, eval_file=None, name="run", **train) -> Path:
    data = {"source": str(train_file), "format": "prompt_completion", "synthetic": {}, "max_length": 40,
            "val_size": 4}
    sections = {"eval": {"data": {"source": str(eval_file), "format": "prompt_completion"}, "max_new_tokens": 4,
                         "batch_size": 4}} if eval_file else {}
    return recipe_file(tmp_path, model_dir, name=name, data=data, train={**FAST, **train}, **sections)


def test_a_train_reads_its_data_files_once_and_checks_its_model_folder_once(tmp_path, tiny_model_dir, opens,
                                                                            monkeypatch):
    train_file = sums(tmp_path / "train.jsonl", TRAIN_PAIRS)
    eval_file = sums(tmp_path / "heldout.jsonl", [(1, 1), (20, 30), (40, 50), (60, 70)])  # 1 + 1 is trained on
    path = file_recipe(tmp_path, tiny_model_dir, train_file, eval_file)
    opens.watch(train_file, eval_file)
    folder_checks = calls_of(monkeypatch, loading, "check_model_dir")
    context_reads = calls_of(monkeypatch, context, "config_context")
    r = run_cli("train", path)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "accuracy" in row] == [2]  # the held-out slice was answered
    assert opens[train_file] == 1  # the checks before loading, setup and the contamination count share one parse
    assert opens[eval_file] == 1  # checked against the training problems before loading, then answered
    assert [Path(a[0]) for a in folder_checks] == [tiny_model_dir]
    assert [Path(a[0]) for a in context_reads] == [tiny_model_dir]
    assert "1 of the 4 held-out problems (eval.data) are training problems too" in " ".join(r.output.split())


def test_a_data_file_changed_or_read_differently_is_read_again(tmp_path, opens):
    path = sums(tmp_path / "d.jsonl", [(1, 2), (3, 4)])
    cfg = load_recipe(file_recipe(tmp_path, tmp_path, path)).data
    opens.watch(path)
    first = load_examples(cfg)
    assert [e.completion for e in load_examples(cfg)] == [e.completion for e in first] == ["3", "7"]
    assert opens[path] == 1
    assert load_examples(cfg.model_copy(update={"limit": 1}))[0].completion == "3"  # another section: its own parse
    assert opens[path] == 2
    st = path.stat()
    replacement = sums(tmp_path / "new.jsonl", [(5, 6), (7, 8)])  # the same size, its times set to the old file's
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, path)  # as an editor or a download saves a file: another inode under the same name
    assert [e.completion for e in load_examples(cfg)] == ["11", "15"]
    assert opens[path] == 3
    assert len(pipeline._PARSED) <= pipeline.PARSED_KEPT


@pytest.mark.parametrize("eval_data,said", [
    (None, ["with eval.data unset the eval set is the training data itself", "the first 4 problems"]),
    ("train.jsonl", ["the same file as data.source", "4 of them (100.0 %) are problems of data.source"]),
    ("copy.jsonl", ["copy.jsonl", "3 of them (75.0 %) are problems of data.source"]),
])
def test_a_held_out_slice_of_training_problems_is_refused_by_check_and_train_alike(tmp_path, tiny_model_dir,
                                                                                    eval_data, said):
    train_file = sums(tmp_path / "train.jsonl", TRAIN_PAIRS)
    sums(tmp_path / "copy.jsonl", [(1, 1), (1, 2), (99, 99), (1, 3)])  # 3 of its first 4 are trained on
    path = file_recipe(tmp_path, tiny_model_dir, train_file, tmp_path / eval_data if eval_data else None)
    check, train = run_cli("recipe", "check", path), run_cli("train", path)
    for r in (check, train):
        refused(r, *said, "eval.data", "Set eval.data to problems kept out of training")
    message = " ".join(check.output.split())
    assert message[message.index("error"):] in " ".join(train.output.split())  # the same paragraph
    assert not (tmp_path / "run").exists()  # refused before any run directory or weights


def test_a_held_out_file_of_fresh_problems_or_no_accuracy_steps_pass_the_check(tmp_path, tiny_model_dir):
    train_file = sums(tmp_path / "train.jsonl", TRAIN_PAIRS)
    fresh = sums(tmp_path / "fresh.jsonl", [(1, 1), (50, 60), (70, 80), (90, 10)])  # 1 of 4: said, not refused
    ok = run_cli("recipe", "check", file_recipe(tmp_path, tiny_model_dir, train_file, fresh))
    assert ok.exit_code == 0 and "valid recipe" in ok.output, ok.output
    off = run_cli("recipe", "check", file_recipe(tmp_path, tiny_model_dir, train_file, name="off", accuracy_steps=0))
    assert off.exit_code == 0 and "valid recipe" in off.output, off.output
