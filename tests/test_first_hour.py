"""What a newcomer met in the first hour (issue 37, item 6), each planted for real: keep_best keeping a worse model;
a tracker that is installed but fails to import; `recipe check` saying "valid" for what `train` refuses; cheap
arguments refused only after expensive work; messages that hid the cause; minutes of silence (the converter's pip,
an eval writing to a file); Ctrl-C handlers left behind by in-process commands; a busy CPU.
(`delft eval --fewshot` past the model's context: tests/test_model_file_refusals.py.)"""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import lora_run, recipe_file, run_cli, write_yaml

import delft.training.sft as train_mod
from delft.recipe.files import load_recipe
from delft.rundir import read_info
from delft.training.early_stopping import EarlyStopping
from delft.training import precheck
from delft.training.precheck import busy_machine
from delft.training.stages import run_training

FAST = ["--set", "eval.max_new_tokens=2", "--set", "eval.batch_size=2", "--set", "eval.bootstrap=10"]


def refused(r, *words: str) -> str:
    """Exit 2, one paragraph (no traceback), naming every one of ``words``; the text, whitespace folded."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.output.count("error:") == 1, r.output
    text = " ".join(r.output.split())
    for w in words:
        assert w in text, (w, r.output)
    return text


def delft(*args, env=None, **kw) -> subprocess.CompletedProcess:
    """``python -m delft ARGS`` in a fresh process, output captured unless ``kw`` says where it goes (either way
    stdout is not a terminal)."""
    kw = {"capture_output": True, **kw} if "stdout" not in kw else kw
    return subprocess.run([sys.executable, "-m", "delft", *map(str, args)], text=True,
                          env={**os.environ, **(env or {})}, timeout=600, **kw)


# ----------------------------------------------------------------------------- keep_best keeps the lowest

ISSUE = [(5, 3.64), (10, 3.08), (15, 2.68)]  # the issue's run: val_loss at steps 5, 10, 15, min_delta 0.5


def test_the_best_is_the_lowest_measured_whatever_min_delta_says():
    t = EarlyStopping("val_loss", min_delta=0.5, patience=3)
    for step, value in ISSUE:
        t.update(value, step)
    assert (t.best_step, t.best) == (15, 2.68)  # was step 10: 2.68 is not 0.5 below 3.08
    assert t.bad == 1 and not t.should_stop  # ...so it counts toward patience, from step 10's 3.08
    for step, value in [(20, 2.60), (25, 2.59)]:
        t.update(value, step)
    assert t.should_stop and (t.best_step, t.best) == (25, 2.59)  # stops on patience, keeps the lowest
    assert "did not improve on step 10's 3.08 by more than 0.5" in t.summary(25)["stopped_early"]["why"]
    acc = EarlyStopping("heldout_accuracy", min_delta=0.1, patience=2)
    for step, value in [(1, 0.50), (2, 0.55), (3, 0.52)]:
        acc.update(value, step)
    assert (acc.best_step, acc.best, acc.should_stop) == (2, 0.55, True)  # higher is better, the same rule


def test_a_run_with_keep_best_keeps_the_issue_s_lowest_step(tmp_path, tiny_model_dir, monkeypatch):
    from delft.training.step import evaluate_loss

    left = iter(v for _, v in ISSUE)

    def scripted(*a, **k):  # the real validation runs; its value is the issue's
        out = evaluate_loss(*a, **k)
        out["val_loss"] = next(left)
        return out

    monkeypatch.setattr(train_mod, "evaluate_loss", scripted)
    train = {"max_steps": 15, "eval_steps": 5, "save_steps": 15, "batch_size": 2, "keep_best": True,
             "early_stopping": {"metric": "val_loss", "patience": 3, "min_delta": 0.5}}
    info = read_info(run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train=train))))
    assert (info["best"]["step"], info["best"]["value"]) == (15, 2.68), info["best"]
    assert "the lowest val_loss of 3 measurements" in info["best"]["why"]


# ----------------------------------------------------------------------------- a tracker that fails to import

BROKEN = {  # backend -> what its import raises here (a protobuf clash raises TypeError from the generated code)
    "wandb": "raise ImportError(\"cannot import name 'builder' from 'google.protobuf.internal'\")",
    "tensorboard": "raise TypeError('Descriptors cannot be created directly. protobuf clash')",
}


@pytest.mark.parametrize("backend", sorted(BROKEN))
def test_an_installed_tracker_that_fails_to_import_is_refused_before_anything(tmp_path, tiny_model_dir, backend):
    shadow = tmp_path / "site"  # first on the path: the package is found (installed) and its import fails
    (shadow / backend).mkdir(parents=True)
    (shadow / backend / "__init__.py").write_text(BROKEN[backend] + "\n")
    recipe = recipe_file(tmp_path, tiny_model_dir, train={"report_to": [backend]})
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    for command in (["recipe", "check"], ["train"]):
        r = delft(*command, recipe, env=env)
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 2 and "Traceback" not in out, out
        assert f"train.report_to lists {backend}, but" in out and "fails to import" in out, out
        assert ("builder" if backend == "wandb" else "Descriptors cannot be created") in out, out
        assert "valid recipe" not in out
    assert not (tmp_path / "run").exists()  # no run directory begun (it used to hold recipe.yaml alone)


# ----------------------------------------------------------------------------- recipe check == train's checks


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


ON_THIS_CPU = ("cuda without a GPU", "paged adam on the CPU")  # refusals of a machine without CUDA
CASES = {  # name -> (recipe sections, words of the one paragraph both commands print)
    "cuda without a GPU": ({"model": {"device": "cuda"}}, ["model.device", "no CUDA GPU"]),
    "paged adam on the CPU": ({"model": {"device": "cpu"}, "train": {"optimizer": "paged_adamw_8bit"}},
                              ["train.optimizer paged_adamw_8bit", "on the CPU"]),
    "lora keys under full": ({"train": {"finetuning": "full"}, "lora": {"r": 8, "dropout": 0.1}},
                             ["ignores the lora section", "lora.r", "lora.dropout"]),
    "an empty data file": ({"data": {"source": "EMPTY", "format": "prompt_completion"}},
                           ["empty.jsonl", "is empty"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_check_refuses_what_train_refuses_and_train_refuses_it_before_loading(tmp_path, case):
    sections, words = CASES[case]
    if case in ON_THIS_CPU and _cuda():
        pytest.skip("this machine has a CUDA GPU")
    (tmp_path / "empty.jsonl").write_text("")
    data = sections.get("data", {})
    if data.get("source") == "EMPTY":
        sections = {**sections, "data": {**data, "source": str(tmp_path / "empty.jsonl")}}
    model = tmp_path / "no-model"  # never read: every refusal here comes before a model loads
    recipe = recipe_file(tmp_path, model, **sections)
    refused(run_cli("recipe", "check", recipe), *words)
    refused(run_cli("train", recipe), *words)
    assert not (tmp_path / "run").exists()


def test_recipe_check_plan_sizes_a_run_for_another_machine_and_says_what_train_would_refuse_here(
        tmp_path, tiny_model_dir):
    if _cuda():
        pytest.skip("this machine has a CUDA GPU")
    r = run_cli("recipe", "check", recipe_file(tmp_path, tiny_model_dir, model={"device": "cuda"}), "--plan")
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "train would refuse this recipe on this machine" in text and "no CUDA GPU" in text
    assert "Planned peak GPU memory" in text


@pytest.mark.parametrize("args,words", [
    (["recipe", "check", "RECIPE", "--plan", "--gpu-memory", "lots"], ["--gpu-memory 'lots' is not a memory size"]),
    (["eval", "--model", "MODEL", "--data", "synthetic", "--limit", "0"], ["--limit must be positive"]),
    (["eval", "--model", "MODEL", "--data", "synthetic", "--json", "DIR"], ["is a directory"]),
])
def test_cheap_arguments_are_refused_before_the_expensive_work(tmp_path, args, words):
    """The model does not exist: a refusal of the argument proves nothing was planned or loaded first."""
    (tmp_path / "out").mkdir()
    fill = {"RECIPE": recipe_file(tmp_path, tmp_path / "no-model"), "MODEL": tmp_path / "no-model",
            "DIR": tmp_path / "out"}
    text = refused(run_cli(*[fill.get(a, a) for a in args]), *words)
    assert "valid recipe" not in text and "Planned" not in text and "no-model" not in text


# ----------------------------------------------------------------------------- messages that hid the cause


def test_yaml_null_and_a_scalar_section_are_said_plainly(tmp_path):
    path = write_yaml(tmp_path / "r.yaml", {"output": {"dir": str(tmp_path / "run")}})
    refused(run_cli("recipe", "check", path, "--set", "output.dir=~"), "output.dir",
            "YAML reads ~, null and an empty value as null", "quote it")
    path.write_text("model: gpt2\n")
    text = refused(run_cli("recipe", "check", path), "model: is a section of keys", "its keys: name",
                   "(got 'gpt2')")
    assert "instance of" not in text and "ModelConfig" not in text


def test_eval_names_a_missing_run_before_asking_for_model_and_data(tmp_path):
    refused(run_cli("eval", tmp_path / "runs" / "nothere"), str(tmp_path / "runs" / "nothere"), "does not exist")


def test_eval_says_why_the_recipe_s_run_is_left_out(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir, name="never-trained")
    r = run_cli("eval", "--model", tiny_model_dir, recipe, "--limit", "1", *FAST)
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert f"not including the recipe's run: {tmp_path / 'never-trained'} (output.dir) does not exist" in text


def test_export_refuses_an_out_inside_the_run(tmp_path, tiny_model_dir):
    run = lora_run(tiny_model_dir, tmp_path / "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    refused(run_cli("export", run, "--out", run / "sub"), "is inside the run directory", "--out")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written into the run


# ----------------------------------------------------------------------------- minutes of silence

FAKE_PIP = """import json, os, sys
with open(os.environ["FAKE_PIP_LOG"], "w") as f:
    json.dump(sys.argv[1:], f)
print("Downloading llama_cpp_python-0.3.36.tar.gz (fake pip's progress)", flush=True)
sys.exit(1)
"""


def test_the_converter_download_fetches_only_llama_cpp_python_s_source_and_shows_pip(tmp_path):
    """A stand-in `pip` first on the path records its arguments: before, `--no-binary :all:` and `--quiet`."""
    shadow = tmp_path / "site" / "pip"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "__main__.py").write_text(FAKE_PIP)
    env = {k: v for k, v in os.environ.items() if k != "DELFT_LLAMA_CPP_SDIST"}
    env.update(PYTHONPATH=os.pathsep.join([str(shadow.parent), env.get("PYTHONPATH", "")]),
               DELFT_CACHE=str(tmp_path / "cache"), FAKE_PIP_LOG=str(tmp_path / "pip.json"))
    code = ("from delft.errors import UserError\nfrom delft.export.gguf import ensure_converter\n"
            "try:\n    ensure_converter()\nexcept UserError as e:\n    print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    args = json.loads((tmp_path / "pip.json").read_text())
    assert args[0] == "download" and "--no-deps" in args, args
    assert args[args.index("--no-binary") + 1] == "llama-cpp-python" and ":all:" not in args, args
    assert "--quiet" not in args and "-q" not in args, args
    assert "fake pip's progress" in r.stdout  # pip's own output reaches the user
    assert "fetching llama.cpp's converter once" in r.stderr
    assert "REFUSED" in r.stdout and "pip exited with 1" in r.stdout, r.stdout + r.stderr


def test_eval_into_a_file_prints_a_line_per_model_and_its_progress(tmp_path, tiny_model_dir, tiny_lora_run):
    with open(tmp_path / "out.txt", "w") as f:  # stdout a file: rich's live display draws nothing
        r = delft("eval", "--model", tiny_model_dir, "--data", "synthetic", "--limit", "4", *FAST, tiny_lora_run,
                  stdout=f, stderr=subprocess.STDOUT)
    out = (tmp_path / "out.txt").read_text()
    assert r.returncode == 0, out
    for name in ("base", tiny_lora_run.name):
        assert f"{name}: loading, then answering 4 problems" in out, out
        assert f"{name}: 4/4 problems answered" in out, out
    assert out.index("base: 4/4") < out.index(f"{tiny_lora_run.name}: loading")  # as it happens, model by model


# ----------------------------------------------------------------------------- Ctrl-C handlers, a busy CPU


def _mine(signum, frame):  # the test process's own handlers (pytest's, a user's): delft must put them back
    raise KeyboardInterrupt


def test_in_process_commands_give_back_the_signal_handlers_and_a_busy_cpu_is_named(tmp_path, tiny_model_dir,
                                                                                    monkeypatch):
    import torch

    before = {s: signal.signal(s, _mine) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # as a fresh process: torch's own count is the 2 just set, and nothing of this process's own CPU time is
        # taken off the load (pytest's process has been busy since an earlier test's choice)
        precheck.torch_threads.cache_clear()
        monkeypatch.setattr(precheck, "_LAST_CHOICE", [])
        cores = os.cpu_count() or 1
        monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * cores, 4.0 * cores, 4.0 * cores))  # the machine's load
        recipe = recipe_file(tmp_path, tiny_model_dir, model={"name": str(tiny_model_dir), "device": "cpu"},
                             train={"max_steps": 2, "eval_steps": 2, "save_steps": 2})
        trained = run_cli("train", recipe)
        assert trained.exit_code == 0, trained.output
        text = " ".join(trained.output.split())
        assert f"the CPU is busy (load {4.0 * cores:.1f} on {cores} cores)" in text, text
        assert "OMP_NUM_THREADS=1" in text and "docs/performance.md" in text
        for args in (["recipe", "check", recipe], ["train", tmp_path / "missing.yaml"]):
            run_cli(*args)
        assert signal.getsignal(signal.SIGINT) is _mine and signal.getsignal(signal.SIGTERM) is _mine
    finally:
        torch.set_num_threads(threads)
        precheck.torch_threads.cache_clear()
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("load,cores,threads,named", [
    (9.0, 2, 2, True), (2.0, 2, 2, False), (9.0, 2, 1, False), (0.0, 16, 16, False)])
def test_oversubscription_is_load_above_the_cores_with_more_than_one_thread(load, cores, threads, named):
    note = busy_machine(load, cores, threads)
    assert (note is not None) == named
    if named:
        assert "OMP_NUM_THREADS=1" in note and "torch.set_num_threads(1)" in note
