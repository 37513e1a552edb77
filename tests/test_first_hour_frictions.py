"""The first hour of a new user (issue 52, item 5): each friction a test."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO, run_cli, write_yaml

from delft.errors import UserError
from delft.export.gguf import prepare_gguf
from delft.models.sources import resolve_model
from delft.training.precheck import thread_choice


def words(result) -> str:
    return " ".join(result.output.split())


def test_a_data_file_without_a_format_names_the_users_source_and_the_fix(tmp_path):
    out = words(run_cli("recipe", "check", write_yaml(tmp_path / "r.yaml", {"data": {"source": "my.jsonl"}})))
    assert "source 'my.jsonl' is not 'synthetic', so it needs a format" in out
    assert "add format: prompt_completion" in out and "source 'synthetic' goes with" not in out
    # a format given explicitly against a generator's source keeps the plain rule
    explicit = words(run_cli("recipe", "check", write_yaml(tmp_path / "s.yaml", {"data": {"format": "synthetic",
                                                                                          "source": "my.jsonl"}})))
    assert "source 'synthetic' goes with format 'synthetic'" in explicit


def test_the_offline_refusal_advises_the_hf_command_the_hub_ships_now(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(UserError) as e:
        resolve_model("nobody/nothing")
    assert "hf download nobody/nothing --local-dir DIR" in str(e.value) and "huggingface-cli" not in str(e.value)


@pytest.mark.parametrize("types, verb", [(["q4_k_m"], "q4_k_m needs"), (["q4_k_m", "q5_k_m"], "q4_k_m, q5_k_m need")])
def test_the_quantiser_refusal_agrees_with_its_subject(tmp_path, types, verb):
    pytest.importorskip("gguf")
    if subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        pytest.skip("llama-cpp-python is installed: nothing to refuse")
    with pytest.raises(UserError) as e:
        prepare_gguf(tmp_path / "run", tmp_path / "out", types)
    assert f"{verb} llama.cpp's quantiser" in str(e.value)


def test_inspect_help_shows_the_prompt_and_the_runs_compare_takes():
    shown = words(run_cli("inspect", "--help", env={"COLUMNS": "200"}))
    assert "[RECIPE.yaml] [RUN_DIR...] PROMPT" in shown and "the arguments between the recipe and the prompt" in shown
    missing = words(run_cli("inspect"))
    assert "Missing argument '[RECIPE.yaml] [RUN_DIR...] PROMPT'" in missing and "'targets'" not in missing


@pytest.mark.slow  # two pytest collections in subprocesses
def test_real_model_and_llama_cpp_tests_are_slow_by_their_marker():
    """`-m "not slow"` leaves out every test marked smollm2 or gguf, though test_fsdp's SmolLM2 tests carry no slow."""
    files = [str(REPO / "tests" / "training" / "test_fsdp.py"), str(REPO / "tests" / "export" / "test_gguf.py")]
    ids = {}
    for selection in ("slow", "not slow"):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                            "-m", selection, *files], cwd=REPO, capture_output=True, text=True, timeout=300)
        ids[selection] = [line for line in r.stdout.splitlines() if "::" in line]
    assert any("smollm2" in i for i in ids["slow"])
    marked = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             "-m", "smollm2 or gguf", *files], cwd=REPO, capture_output=True, text=True, timeout=300)
    heavy = {line for line in marked.stdout.splitlines() if "::" in line}
    assert heavy and not heavy & set(ids["not slow"]), heavy & set(ids["not slow"])


@pytest.mark.parametrize("load, env, chosen", [
    (9.0, {}, 1),  # busy: one thread, said
    (1.0, {}, None),  # free: torch's own count
    (9.0, {"OMP_NUM_THREADS": "2"}, None),  # the user chose
    (9.0, {"DELFT_THREADS": "3"}, 3), (1.0, {"DELFT_THREADS": "1"}, 1)])
def test_delft_chooses_the_threads_for_the_machines_load_and_a_setting_overrides_it(load, env, chosen):
    threads, note = thread_choice(load, 2, 2, env)
    assert threads == chosen
    assert (note is not None) == (chosen is not None)
    if env == {}:
        assert note is None or ("torch runs 1 thread a process instead of 2" in note and "DELFT_THREADS=N" in note)


def test_a_bad_thread_setting_is_refused():
    with pytest.raises(UserError, match="DELFT_THREADS='many'"):
        thread_choice(0.0, 2, 2, {"DELFT_THREADS": "many"})
