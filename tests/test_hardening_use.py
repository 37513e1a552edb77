"""Bad inputs to eval, inspect, export and compare: one paragraph and exit 2, nothing lost (issue 19).

Real files and real tiny models throughout: a finished run (helpers.lora_run) copied and then damaged the way a
disk, a copy or a user damages it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_only_dir, recipe_file, refused, run_cli

from delft.errors import UserError
from delft.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RUN_INFO

FAST = ["--set", "eval.max_new_tokens=2", "--set", "eval.batch_size=2", "--set", "eval.bootstrap=10"]
PROMPT = "What is 5 + 7?"


def eval_args(model: Path, *runs, extra=()) -> list:
    return ["eval", "--model", model, "--data", "synthetic", "--limit", "2", *FAST, *extra, *runs]


@pytest.fixture
def run_copy(tiny_lora_run, tmp_path) -> Path:
    """A fresh copy of the finished tiny run, to damage."""
    return Path(shutil.copytree(tiny_lora_run, tmp_path / "run"))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "truncated weights": lambda run: truncate(run / ADAPTER_WEIGHTS[0]),
    "empty weights": lambda run: (run / ADAPTER_WEIGHTS[0]).write_bytes(b""),
    "undecodable config": lambda run: (run / ADAPTER_CONFIG).write_bytes(b"\xff\xfe{\x00garbage"),
}


# ------------------------------------------------------------------------------------------- damaged adapters


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_eval_refuses_a_damaged_adapter_before_the_base_is_evaluated(damage, tiny_model_dir, tiny_lora_run,
                                                                     run_copy, tmp_path):
    DAMAGE[damage](run_copy)
    out = tmp_path / "eval.json"
    r = run_cli(*eval_args(tiny_model_dir, tiny_lora_run, run_copy, extra=["--json", out]))
    name = ADAPTER_CONFIG if "config" in damage else ADAPTER_WEIGHTS[0]
    refused(r, str(run_copy / name), "damaged")
    assert "problems from" not in r.output  # no table: refused before the first model ran
    assert not out.exists()


def test_inspect_and_export_refuse_a_truncated_adapter(tiny_model_dir, run_copy, tmp_path):
    DAMAGE["truncated weights"](run_copy)
    refused(run_cli("inspect", "--adapter", run_copy, "--target", "12", PROMPT), str(run_copy / ADAPTER_WEIGHTS[0]))
    refused(run_cli("inspect", "--compare", "base", run_copy, "--target", "12", PROMPT), ADAPTER_WEIGHTS[0])
    out = tmp_path / "merged"
    refused(run_cli("export", run_copy, "--out", out), str(run_copy / ADAPTER_WEIGHTS[0]), "damaged")
    assert not out.exists() and not list(tmp_path.glob(".merged*"))


def test_a_truncated_merged_model_is_refused_by_name(tiny_model_dir, tmp_path):
    merged = Path(shutil.copytree(tiny_model_dir, tmp_path / "merged"))
    weights = next(merged.glob("*.safetensors"))
    truncate(weights)
    refused(run_cli(*eval_args(tiny_model_dir, merged)), str(weights))
    refused(run_cli("inspect", "--model", merged, "--target", "12", PROMPT), str(weights))


@pytest.mark.parametrize("command", ["eval", "inspect", "export", "compare"])
def test_a_corrupt_run_info_is_named_in_every_command(command, tiny_model_dir, run_copy, tmp_path):
    info = run_copy / RUN_INFO
    if command == "compare":  # the run compare would reuse for ce.yaml, seed 0
        recipe_file(tmp_path, tiny_model_dir, name="ce", loss={"type": "ce"})
        de = recipe_file(tmp_path, tiny_model_dir, name="del", loss={"type": "del"})
        info = Path(shutil.copytree(run_copy, tmp_path / "ce-seed0")) / RUN_INFO
    info.write_text('{"status": "completed", "base_mo')
    args = {"eval": eval_args(tiny_model_dir, run_copy),
            "inspect": ["inspect", "--adapter", run_copy, "--target", "12", PROMPT],
            "export": ["export", run_copy, "--out", tmp_path / "merged"],
            "compare": ["compare", tmp_path / "ce.yaml", tmp_path / "del.yaml", "--out", tmp_path / "res"]}[command]
    refused(run_cli(*args), str(info), "cannot be read")
    if command == "compare":
        assert not (tmp_path / "del-seed0").exists() and de.is_file()  # refused before training anything


def test_eval_of_a_file_instead_of_a_run_directory(tiny_model_dir, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("not a run")
    refused(run_cli(*eval_args(tiny_model_dir, f)), str(f), "is a file")
    refused(run_cli("inspect", "--adapter", f, "--target", "12", PROMPT), str(f), "is a file")


# ------------------------------------------------------------------------------------------- outputs


def test_eval_json_and_plot_paths_are_checked_before_any_model_runs(tiny_model_dir, tmp_path):
    a_dir = tmp_path / "results"
    a_dir.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    refused(run_cli(*eval_args(tiny_model_dir, extra=["--json", a_dir])), str(a_dir), "is a directory", "--json")
    refused(run_cli(*eval_args(tiny_model_dir, extra=["--plot", a_file / "p.png"])), "is a file", "--plot")
    same = tmp_path / "x.json"
    refused(run_cli(*eval_args(tiny_model_dir, extra=["--json", same, "--plot", same])), "same file")
    assert a_file.read_text() == "keep me" and not same.exists() and list(a_dir.iterdir()) == []
    with read_only_dir(tmp_path / "locked") as locked:
        r = run_cli(*eval_args(tiny_model_dir, extra=["--json", locked / "sub" / "eval.json"]))
        refused(r, "cannot write in", str(locked))
        assert "problems from" not in r.output


def test_inspect_json_and_plot_paths_are_checked_first(tiny_model_dir, tmp_path):
    refused(run_cli("inspect", "--model", tiny_model_dir, "--target", "12", "--plot", tmp_path, PROMPT),
            "is a directory", "--plot")
    with read_only_dir(tmp_path / "locked") as locked:
        refused(run_cli("inspect", "--model", tiny_model_dir, "--target", "12", "--json", locked / "i.json", PROMPT),
                "cannot write in", "--json")


def test_write_result_failure_is_one_paragraph_and_leaves_nothing(tmp_path):
    from delft.outputs import write_result

    with read_only_dir(tmp_path / "locked") as locked:
        with pytest.raises(UserError, match="could not write .*x.json"):
            write_result(locked / "x.json", "{}", "--json")
        assert list(locked.iterdir()) == []


def test_inspect_refuses_a_target_in_other_digits(tiny_model_dir):
    for target in ("٤٢", "１２"):  # Arabic-Indic, full-width: \d matches them, the tokenizer does not
        refused(run_cli("inspect", "--model", tiny_model_dir, "--target", target, PROMPT), "digits 0-9", "--target")


def test_inspect_refuses_a_prompt_past_the_models_context_before_generating(tiny_model_dir, monkeypatch):
    """The tiny model's max_position_embeddings is 512 (one token a character); a longer prompt used to generate
    on past the model's positions (minutes on a real model, printing nothing)."""
    from types import SimpleNamespace

    import delft.inspection.command as command
    from delft.models.context import check_context

    def no_generation(*args, **kwargs):
        raise AssertionError("generated although the prompt does not fit")

    monkeypatch.setattr(command, "greedy_answer", no_generation)
    long_prompt = "1 + 1 " * 100  # 600 characters: 600 prompt tokens and more with the chat template
    refused(run_cli("inspect", "--model", tiny_model_dir, long_prompt), "context of 512 tokens",
            "--max-new-tokens is 32", "max_position_embeddings", "Shorten the prompt to 480 tokens or fewer")
    refused(run_cli("inspect", "--model", tiny_model_dir, "--target", "12", long_prompt), "context of 512 tokens",
            "the --target answer is 2", "Shorten the prompt to 510 tokens or fewer")
    refused(run_cli("inspect", "--model", tiny_model_dir, "--max-new-tokens", "600", PROMPT),
            "--max-new-tokens is 600", "Pass --max-new-tokens")
    near = "x" * 470  # fits alone; with 40 new tokens it does not: both fixes are offered, with their numbers
    r = run_cli("inspect", "--model", tiny_model_dir, "--max-new-tokens", "40", near)
    n = int(" ".join(r.output.split()).split("the prompt is ")[1].split(" ")[0])
    refused(r, f"{n + 40} tokens, more than", f"Shorten the prompt to 472 tokens or fewer, or pass --max-new-tokens "
            f"{512 - n} or fewer")
    check_context(SimpleNamespace(config=SimpleNamespace()), 10_000, 32, "m", "delft inspect")  # no limit


# ------------------------------------------------------------------------------------------- export


def test_export_out_in_a_read_only_directory_is_refused_before_merging(tiny_lora_run, tmp_path):
    with read_only_dir(tmp_path / "locked") as locked:
        refused(run_cli("export", tiny_lora_run, "--out", locked / "merged"), "cannot write in", str(locked), "--out")
    parent_file = tmp_path / "file"
    parent_file.write_text("keep me")
    refused(run_cli("export", tiny_lora_run, "--out", parent_file / "merged"), "is a file", "--out")
    assert parent_file.read_text() == "keep me"


def test_export_follows_the_umask(tiny_lora_run, tmp_path):
    out = tmp_path / "merged"
    old = os.umask(0o027)
    try:
        r = run_cli("export", tiny_lora_run, "--out", out, "--dtype", "float32")
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o640}


def test_export_refuses_an_out_another_export_is_writing(tiny_lora_run, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".merged.tmp-{other.pid}-abc").mkdir()  # what a running export keeps beside its --out
        refused(run_cli("export", tiny_lora_run, "--out", tmp_path / "merged"), f"process {other.pid}", "--out")
    finally:
        other.kill()
        other.wait()
    assert not (tmp_path / "merged").exists()


def test_an_out_filled_meanwhile_is_kept_and_so_is_this_export(tmp_path):
    from delft.export.merge import _swap_into_place

    out, tmp = tmp_path / "merged", tmp_path / ".merged.tmp-1-x"
    out.mkdir()
    (out / "theirs").write_text("the other export")
    tmp.mkdir()
    (tmp / "ours").write_text("this export")
    with pytest.raises(UserError, match="another process") as e:
        _swap_into_place(tmp, out, force=False)
    kept = Path(str(e.value).split("kept in ")[1].split(":")[0])
    assert (out / "theirs").read_text() == "the other export" and (kept / "ours").read_text() == "this export"


# ------------------------------------------------------------------------------------------- compare


def test_compare_refuses_a_recipe_twice_or_alone(tiny_model_dir, tmp_path):
    ce = recipe_file(tmp_path, tiny_model_dir, name="ce", loss={"type": "ce"})
    refused(run_cli("compare", ce, ce, "--out", tmp_path / "res"), "given twice")
    refused(run_cli("compare", ce, tmp_path / "." / "ce.yaml", "--out", tmp_path / "res"), "given twice")
    refused(run_cli("compare", ce, "--out", tmp_path / "res"), "at least two recipes")
    assert not (tmp_path / "ce-seed0").exists() and not (tmp_path / "res").exists()  # nothing trained


def test_compare_out_is_checked_before_training(tiny_model_dir, tmp_path):
    ce = recipe_file(tmp_path, tiny_model_dir, name="ce", loss={"type": "ce"})
    de = recipe_file(tmp_path, tiny_model_dir, name="del", loss={"type": "del"})
    a_file = tmp_path / "results"
    a_file.write_text("keep me")
    refused(run_cli("compare", ce, de, "--out", a_file), "is a file", "--out")
    with read_only_dir(tmp_path / "locked") as locked:
        refused(run_cli("compare", ce, de, "--out", locked / "res"), "cannot write in", "--out")
    assert a_file.read_text() == "keep me" and not (tmp_path / "ce-seed0").exists()


def test_eval_keeps_the_base_results_when_a_later_model_fails_to_load(tiny_model_dir, tmp_path):
    import json

    from helpers import lora_run
    from tiny import save_tiny

    other = save_tiny(tmp_path / "wide", hidden=64)
    bare = lora_run(other, tmp_path / "bare", info=False)  # no run info: only loading finds the mismatch
    out = tmp_path / "eval.json"
    r = run_cli(*eval_args(tiny_model_dir, bare, extra=["--json", out]))
    refused(r, "does not fit", "evaluated before it (base)", str(out))
    report = json.loads(out.read_text())
    assert [m["name"] for m in report["models"]] == ["base"] and "does not fit" in report["incomplete"]
    assert len(report["models"][0]["predictions"]) == 2


def test_recipe_check_plan_names_a_corrupt_config(tiny_model_dir, tmp_path):
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model / "config.json").write_bytes(b"\x80\x81 not json")
    recipe = recipe_file(tmp_path, model)
    refused(run_cli("recipe", "check", recipe, "--plan", "--gpu-memory", "8GiB"), str(model / "config.json"), "damaged")


def test_compare_report_skips_a_damaged_metrics_line(tmp_path):
    from delft.experiments.arms import _last_rows
    from delft.rundir import METRICS

    (tmp_path / METRICS).write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "val_loss": 1.5}\n{"step": 3, "lo\xff')
    assert _last_rows(tmp_path) == {"train": {"step": 1, "loss": 2.0}, "validation": {"step": 2, "val_loss": 1.5}}
