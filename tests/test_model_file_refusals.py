"""Model files someone else made, refused in one paragraph by train, eval, inspect and export (issue 36, items 6-7).

Each case writes the real bad file next to a real tiny model (tests/tiny.py) or run (helpers.lora_run) and runs the
real command: weights only in a pickle (pytorch_model.bin, adapter_model.bin), a config.json transformers rejects,
a .gguf that is not one, an adapter_config.json with wrong types, and eval prompts longer than the model's context.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import recipe_file, run_cli
from safetensors.torch import load_file

from delft.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MODEL_CONFIG, RUN_INFO

FAST = ["--set", "eval.max_new_tokens=2", "--set", "eval.batch_size=2", "--set", "eval.bootstrap=10"]
PROMPT = "What is 5 + 7?"


def refused(r, *words: str) -> str:
    """Exit 2, one paragraph (no traceback, no transformers load report), naming every one of ``words``."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "LOAD REPORT" not in r.output, r.output
    assert r.output.count("error:") == 1, r.output
    text = " ".join(r.output.split())
    for w in words:
        assert w in text, (w, r.output)
    return text


def _config(model: Path, **changes) -> None:
    cfg = json.loads((model / MODEL_CONFIG).read_text())
    cfg.update(changes)
    (model / MODEL_CONFIG).write_text(json.dumps(cfg))


def _pickled_weights(model: Path) -> None:
    """The same weights as pytorch_model.bin only (how older hub models ship)."""
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()


# case: (damage the model directory, the file named, words the refusal must say)
MODEL_DAMAGE = {
    "weights only in pytorch_model.bin": (_pickled_weights, "pytorch_model.bin",
                                          ["safetensors only", "save_pretrained", "pickle"]),
    "unknown model_type": (lambda m: _config(m, model_type="nonsense"), MODEL_CONFIG,
                           ['model_type "nonsense"', "does not know"]),
    "config.json a JSON list": (lambda m: (m / MODEL_CONFIG).write_text("[1, 2, 3]"), MODEL_CONFIG,
                                ["not a JSON object"]),
    "a config value of the wrong type": (lambda m: _config(m, tie_word_embeddings="x"), MODEL_CONFIG,
                                         ["transformers cannot read", "tie_word_embeddings"]),
    "config shapes that do not match the weights": (lambda m: _config(m, hidden_size=64, intermediate_size=128),
                                                    MODEL_CONFIG, ["shapes"]),
}


@pytest.fixture
def bad_model(request, tiny_model_dir, tmp_path) -> tuple[Path, str, list]:
    damage, name, words = MODEL_DAMAGE[request.param]
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    damage(model)
    return model, name, words


def _run_on(base: Path, tiny_lora_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished tiny run that records ``base`` as its base model."""
    run = Path(shutil.copytree(tiny_lora_run, tmp_path / "run"))
    info = json.loads((run / RUN_INFO).read_text())
    (run / RUN_INFO).write_text(json.dumps({**info, "base_model": str(base)}))
    return run


def _command(command: str, model: Path, tiny_lora_run: Path, tmp_path: Path) -> list:
    if command == "train":
        return ["train", recipe_file(tmp_path, model, train={"max_steps": 1})]
    if command == "eval":
        return ["eval", "--model", model, "--data", "synthetic", "--limit", "2", *FAST, "--json", tmp_path / "e.json"]
    if command == "inspect":
        return ["inspect", "--model", model, "--target", "12", PROMPT]
    return ["export", _run_on(model, tiny_lora_run, tmp_path), "--out", tmp_path / "merged"]


@pytest.mark.parametrize("command", ["train", "eval", "inspect", "export"])
@pytest.mark.parametrize("bad_model", list(MODEL_DAMAGE), indirect=True)
def test_a_bad_model_directory_is_one_paragraph_naming_the_file(bad_model, command, tiny_lora_run, tmp_path):
    model, name, words = bad_model
    r = run_cli(*_command(command, model, tiny_lora_run, tmp_path))
    if command == "export" and name == MODEL_CONFIG and "shapes" in words:
        refused(r, "shapes differ")  # export compares the base with the shapes the adapter was trained on first
    else:
        refused(r, str(model / name), *words)
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "merged").exists()


def test_a_model_with_safetensors_beside_its_bin_loads_the_safetensors(tiny_model_dir, tmp_path):
    """The refusal is for weights only in a pickle: a model shipping both formats runs, on its safetensors."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model / "pytorch_model.bin").write_bytes(b"not a pickle: delft must never open this file")
    r = run_cli("inspect", "--model", model, "--target", "12", PROMPT)
    assert r.exit_code == 0, r.output


def test_an_adapter_only_in_adapter_model_bin_is_refused_with_the_conversion(tiny_lora_run, tmp_path):
    run = Path(shutil.copytree(tiny_lora_run, tmp_path / "run"))
    torch.save(load_file(run / ADAPTER_WEIGHTS[0]), run / "adapter_model.bin")
    (run / ADAPTER_WEIGHTS[0]).unlink()
    for args in (["inspect", "--adapter", run, "--target", "12", PROMPT],
                 ["export", run, "--out", tmp_path / "merged"]):
        refused(run_cli(*args), str(run / "adapter_model.bin"), "safetensors only", "save_file")
    assert not (tmp_path / "merged").exists()


# ------------------------------------------------------------------------------------------- GGUF magic

GGUF_DAMAGE = {
    "a web page saved as .gguf": (b"<!DOCTYPE html><html>404 Not Found</html>" * 4, ["not a GGUF file", "<!DO"]),
    "an empty .gguf": (b"", ["not a GGUF file", "is empty"]),
    "GGUF magic, then garbage": (b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, ["could not read the GGUF file"]),
}


# A GGUF run of eval goes to llama.cpp, which reads past the magic itself: only the magic cases there.
GGUF_CASES = [(case, command) for case in GGUF_DAMAGE for command in ("eval --model", "eval RUN", "inspect", "export")
              if not (command == "eval RUN" and GGUF_DAMAGE[case][0].startswith(b"GGUF"))]


@pytest.mark.parametrize("case,command", GGUF_CASES)
def test_a_file_that_is_not_gguf_is_refused_before_any_reader(case, command, tiny_model_dir, tiny_lora_run, tmp_path,
                                                             monkeypatch):
    data, words = GGUF_DAMAGE[case]
    monkeypatch.setenv("DELFT_CACHE", str(tmp_path / "cache"))  # a conversion would be cached here, never in ~
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data)
    args = {"eval --model": ["eval", "--model", gguf, "--data", "synthetic", "--limit", "2", *FAST],
            "eval RUN": ["eval", "--model", tiny_model_dir, "--data", "synthetic", "--limit", "2", *FAST, gguf],
            "inspect": ["inspect", "--model", gguf, "--target", "12", PROMPT],
            "export": ["export", _run_on(gguf, tiny_lora_run, tmp_path), "--out", tmp_path / "merged"]}[command]
    refused(run_cli(*args), str(gguf), *words)
    assert not (tmp_path / "merged").exists()
    assert not list((tmp_path / "cache").rglob("config.json"))  # nothing half-converted was published


# ------------------------------------------------------------------------------------------- adapter_config.json

ADAPTER_DAMAGE = {
    'r: "eight"': ("r", "eight", "whole number above 0"),
    "target_modules: 5": ("target_modules", 5, "a module name or a list"),
    "base_model_name_or_path: 3": ("base_model_name_or_path", 3, "name or path as text"),
    "lora_alpha: [16]": ("lora_alpha", [16], "a number"),
}


@pytest.mark.parametrize("command", ["inspect", "eval", "export"])
@pytest.mark.parametrize("case", list(ADAPTER_DAMAGE))
def test_wrong_types_in_adapter_config_are_one_paragraph(case, command, tiny_model_dir, tiny_lora_run, tmp_path):
    key, value, want = ADAPTER_DAMAGE[case]
    run = Path(shutil.copytree(tiny_lora_run, tmp_path / "run"))
    cfg = json.loads((run / ADAPTER_CONFIG).read_text())
    (run / ADAPTER_CONFIG).write_text(json.dumps({**cfg, key: value}))
    out = tmp_path / "out"
    args = {"inspect": ["inspect", "--adapter", run, "--target", "12", PROMPT],
            "eval": ["eval", "--model", tiny_model_dir, "--data", "synthetic", "--limit", "2", *FAST, "--json", out,
                     run],
            "export": ["export", run, "--out", out]}[command]
    text = refused(run_cli(*args), str(run / ADAPTER_CONFIG), f"{key} is {json.dumps(value)}", want)
    assert "problems from" not in text  # refused before the base model answered
    assert not out.exists()


# ------------------------------------------------------------------------------------------- eval prompts vs context


@pytest.fixture
def no_generation(monkeypatch):
    """Generating at all fails the test: the refusal must come before the first token."""
    import delft.evaluation.model_scores as model_scores

    def refuse(*args, **kwargs):
        raise AssertionError("generated although a prompt does not fit the context")

    monkeypatch.setattr(model_scores, "generate", refuse)  # where delft eval calls it


def _long_prompt_data(tmp_path: Path) -> Path:
    """Three problems; the second's prompt is 900 characters: 900 tokens for the tiny model (512 positions)."""
    rows = [{"prompt": "What is 2 + 3?", "completion": "5"},
            {"prompt": "Add these: " + "1 + " * 222 + "1. What is the sum?", "completion": "223"},
            {"prompt": "What is 4 + 4?", "completion": "8"}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_refuses_a_prompt_past_the_context_before_generating(tiny_model_dir, tmp_path, no_generation):
    out = tmp_path / "eval.json"
    start = time.monotonic()
    r = run_cli("eval", "--model", tiny_model_dir, "--data", _long_prompt_data(tmp_path), "--format",
                "prompt_completion", *FAST, "--json", out)
    text = refused(r, "eval problem 2", "'Add these: 1 + 1 + ", "context of 512 tokens", "max_position_embeddings",
                   "eval.max_new_tokens is 2", "Shorten the prompt to 510 tokens or fewer")
    assert "problems from" not in text and not out.exists()
    assert time.monotonic() - start < 120  # no attention call over a prompt it cannot hold


def test_eval_names_fewer_shots_that_fit_and_they_run(tiny_model_dir, tmp_path, monkeypatch):
    """--fewshot 8 makes every synthetic prompt a few thousand characters: refused, naming the shots that fit;
    eval with those shots then runs."""
    import delft.evaluation.model_scores as model_scores

    real = model_scores.generate
    monkeypatch.setattr(model_scores, "generate", lambda *a, **k: pytest.fail("generated past the context"))
    args = ["eval", "--model", tiny_model_dir, "--data", "synthetic", "--limit", "2", *FAST]
    text = refused(run_cli(*args, "--fewshot", "8"), "2 of 2 prompts do not fit", "context of 512 tokens",
                   "Use fewer exemplars (--fewshot ")
    shots = int(text.split("Use fewer exemplars (--fewshot ")[1].split(" ")[0])
    assert 0 <= shots < 8
    monkeypatch.setattr(model_scores, "generate", real)
    r = run_cli(*args, "--fewshot", str(shots))
    assert r.exit_code == 0, r.output


def test_eval_refuses_a_generation_budget_past_the_context(tiny_model_dir, tmp_path, no_generation):
    r = run_cli("eval", "--model", tiny_model_dir, "--data", "synthetic", "--limit", "2", *FAST,
                "--set", "eval.max_new_tokens=600")
    refused(r, "eval.max_new_tokens is 600", "context of 512 tokens", "Pass --set eval.max_new_tokens=")
