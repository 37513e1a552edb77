"""Signals and full disks everywhere, not only in the training loop: SIGTERM while `delft train` loads or writes
its final files, in `delft eval` and `delft export`; every Ctrl-C of a `delft study`; a disk that fills outside the
checkpoint writer (metrics.jsonl, the run info, the loss curve, a --json result, the export's tokenizer).

Real signals go to real `python -m delft` processes. The full disk is a real small filesystem: a tmpfs of a few
kilobytes mounted for the test (root only; the tests skip where mount is not permitted), so every writer meets
the kernel's own ENOSPC, also the Rust writers (tokenizers, safetensors) that raise it as a plain exception.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DATA, REPO, lora_run, recipe_file, run_cli, write_arms, write_yaml

from delft import signals
from delft.errors import UserError
from delft.models.loading import free_memory
from delft.outputs import append_line, staged, write_atomic, write_result
from delft.rundir import METRICS, RUN_INFO, latest_checkpoint, read_info
from delft.training.lock import lock_path
from delft.training.report import plot_losses


def delft(*args, cwd: Path | None = None) -> subprocess.Popen:
    """`python -m delft ARGS` as a user runs it, in its own process (output unbuffered, so it can be watched)."""
    return subprocess.Popen([sys.executable, "-m", "delft", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env={**os.environ, "COLUMNS": "300", "PYTHONUNBUFFERED": "1"})


def wait_until(proc: subprocess.Popen, ready, timeout: float = 300.0) -> bool:
    """Poll ``ready()`` until it holds (True) or the process ended (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.001)
    proc.kill()
    raise AssertionError("the command did not reach the expected point in time")


def signalled(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Send ``sig``; (exit status, output) once the process has ended."""
    try:
        proc.send_signal(sig)
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    return proc.returncode, out


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    out = proc.communicate(timeout=600)[0]
    return proc.returncode, out


def in_command(proc: subprocess.Popen) -> bool:
    """The command body runs: torch (imported only inside a command, after delft's handlers) is loaded."""
    try:
        return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


def one_paragraph(out: str) -> None:
    assert "Traceback" not in out and "Exception ignored" not in out, out


# -- SIGTERM in delft train, before the loop and during the final write


@pytest.mark.slow
def test_sigterm_while_train_loads_stops_cleanly_and_the_run_starts_later(tmp_path, tiny_model_dir):
    """Tokenizing 4000 examples takes a while; the lock is taken before it, so its file marks start-up."""
    path = recipe_file(tmp_path, tiny_model_dir, name="run", data={"synthetic": {"n": 4000, "max_digits": 3}},
                       train={"max_steps": 2, "save_steps": 10})
    run = tmp_path / "run"
    proc = delft("train", path)
    assert wait_until(proc, lambda: lock_path(run).exists())
    code, out = signalled(proc, signal.SIGTERM)
    one_paragraph(out)
    assert code == 143, out
    assert "Stopped (SIGTERM)." in out and "Training had not begun" in out and f"Resume with: delft train {path}" in out
    assert not (run / RUN_INFO).exists() and not lock_path(run).exists()  # nothing written, the lock released
    code, out = finished(delft("train", path))
    assert code == 0, out
    assert read_info(run)["status"] == "completed"


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_sigterm_at_the_end_of_training_ends_resumable_or_complete(tmp_path, tiny_model_dir, delay):
    """SIGTERM once the last step's validation row is logged: it lands in the loop's tail, in the final write or
    just after it. Each way: exit 143 with "Stopped (SIGTERM)", and the run is complete or resumes to the
    adapter of an uninterrupted run."""
    from helpers import adapter_weights

    sections = {"train": {"max_steps": 3, "eval_steps": 3, "save_steps": 10}}
    reference = recipe_file(tmp_path, tiny_model_dir, name="reference", **sections)
    assert finished(delft("train", reference))[0] == 0
    path = recipe_file(tmp_path, tiny_model_dir, name="run", **sections)
    run = tmp_path / "run"

    def last_validation() -> bool:
        lines = (run / METRICS).read_text().splitlines() if (run / METRICS).is_file() else []
        return any(ln.startswith('{"step": 3,') and '"val_loss"' in ln for ln in lines)

    proc = delft("train", path)
    assert wait_until(proc, last_validation)
    time.sleep(delay)
    code, out = signalled(proc, signal.SIGTERM)
    one_paragraph(out)
    assert code == 143 and "Stopped (SIGTERM)." in out, out
    assert not (run / ".final-tmp").exists()
    if read_info(run)["status"] != "completed":
        assert "Resume with: delft train" in out and latest_checkpoint(run) is not None
        code, out = finished(delft("train", path))
        assert code == 0, out
    assert read_info(run)["status"] == "completed"
    mine, theirs = adapter_weights(run), adapter_weights(tmp_path / "reference")
    assert mine.keys() == theirs.keys() and all((mine[k] == theirs[k]).all() for k in mine)


# -- SIGTERM in delft eval and delft export


def test_sigterm_in_eval_and_export_is_one_line_and_leaves_nothing(tmp_path, tiny_model_dir):
    run = lora_run(tiny_model_dir, tmp_path / "run")
    cases = {
        "eval": (["eval", run, "--data", DATA / "gsm8k_test.jsonl", "--format", "gsm8k", "--limit", "4",
                  "--json", tmp_path / "e.json"], tmp_path / "e.json"),
        "export": (["export", run, "--out", tmp_path / "merged"], tmp_path / "merged"),
    }
    for name, (args, result) in cases.items():
        before = set(tmp_path.iterdir())
        proc = delft(*args)
        assert wait_until(proc, lambda: in_command(proc)), name
        time.sleep(0.5)  # loading the model, evaluating or merging
        code, out = signalled(proc, signal.SIGTERM)
        one_paragraph(out)
        assert code == 143, (name, out)
        assert "Stopped (SIGTERM)" in out, (name, out)
        assert not result.exists() and set(tmp_path.iterdir()) == before, name  # no result, no temporary


# -- every Ctrl-C stops a study, which resumes


@pytest.fixture
def study(tmp_path, tiny_model_dir):
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs", eval={"limit": 2, "max_new_tokens": 2})
    return write_yaml(rec / "tiny.study.yaml", {"recipes": ["ce.yaml", "del.yaml"], "seeds": [0],
                                                "out": str(tmp_path / "out"),
                                                "evals": {"held_out": {"limit": 2, "max_new_tokens": 2}}})


def status(run: Path) -> str:
    try:
        return read_info(run).get("status", "")
    except UserError:  # being written
        return ""


@pytest.mark.slow
def test_every_ctrl_c_stops_a_study_and_the_next_one_reuses_its_runs(tmp_path, study):
    runs = tmp_path / "runs"
    points = {  # (signal, when): at start-up, after the first arm, while the second trains, while evaluating
        "start-up": (signal.SIGINT, lambda: in_command(proc)),
        "after the first arm": (signal.SIGINT, lambda: status(runs / "ce-seed0") == "completed"),
        "the second arm": (signal.SIGTERM, lambda: (runs / "del-seed0" / METRICS).is_file()),
        "evaluating": (signal.SIGINT, lambda: status(runs / "del-seed0") == "completed"),
    }
    stopped = 0
    for name, (sig, ready) in points.items():
        proc = delft("study", study)
        if not wait_until(proc, ready):
            code, out = finished(proc)
            assert code == 0, (name, out)  # it got past this point before we saw it: nothing to stop
            continue
        code, out = signalled(proc, sig)
        one_paragraph(out)
        assert code == 128 + sig, (name, out)
        assert signals.describe(sig) in out, (name, out)
        assert not (tmp_path / "out").exists(), name  # no results from a stopped study
        stopped += 1
    assert stopped >= 3
    code, out = finished(delft("study", study))
    assert code == 0, out
    assert "finished run, reused" in out  # the arms trained before a Ctrl-C are not trained again
    assert (tmp_path / "out" / "study.json").is_file()


class SignalInFinalizer:
    """A cycle whose finalizer gets a real SIGINT (as a Ctrl-C lands in whatever runs): a KeyboardInterrupt
    raised inside a finalizer is lost, so the command would run on."""

    def __init__(self):
        self.me = self

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here, inside the finalizer


def test_a_ctrl_c_during_the_collection_after_an_arm_is_not_lost():
    with signals.stop_on_signals():
        SignalInFinalizer()
        with pytest.raises(KeyboardInterrupt):
            free_memory()  # the gc.collect() between a study's arms
    assert signals.received() is None  # the command's record ends with it


# -- a full disk outside the checkpoint writer


@pytest.fixture
def small_disk(tmp_path):
    """``make(size)``: a fresh tmpfs of ``size`` (e.g. "64k") mounted under tmp_path; unmounted afterwards."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()})")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> None:
    """Take every free block of ``disk`` with a filler file."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def metrics_file(disk: Path) -> Path:
    rows = [{"step": s, "loss": 1.0, "ce": 1.0, "term": 0.1} for s in range(1, 4)]
    path = disk / METRICS
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_tokenizer(disk: Path, model_dir: Path) -> None:
    """A tokenizer saved as the final write and the export save it (tokenizer.json comes from Rust code)."""
    from transformers import AutoTokenizer

    with staged(disk / "tokenizer") as tmp:
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)


WRITERS = {
    "run info": lambda disk, _: write_atomic(disk / RUN_INFO, json.dumps({"status": "running", "pad": "x" * 20000})),
    "metrics.jsonl": lambda disk, _: [append_line(disk / METRICS, json.dumps({"step": 9, "pad": "x" * 500}))
                                      for _ in range(100)],
    "--json": lambda disk, _: write_result(disk / "e.json", "{}" + " " * 20000, "--json"),
    "loss_curve.png": lambda disk, _: plot_losses(disk / METRICS, disk / "loss_curve.png", "del"),
    "tokenizer": save_tokenizer,
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_each_writer_on_a_full_disk_is_one_paragraph_and_writes_nothing_half(small_disk, tiny_model_dir, writer):
    disk = small_disk("64k")
    metrics = metrics_file(disk)
    fill(disk)
    before = {p.name: p.read_bytes() for p in disk.iterdir()}
    with pytest.raises(UserError) as e:
        WRITERS[writer](disk, tiny_model_dir)
    said = str(e.value)
    assert "disk is full" in said and "Free some space" in said and "\n" not in said
    assert writer.lstrip("-") in said or str(disk) in said
    after = {p.name: p.read_bytes() for p in disk.iterdir()}
    assert after.keys() == before.keys()  # no temporary, no half-written file
    assert after.pop(METRICS).startswith(before.pop(METRICS)) and after == before  # whole lines, until it was full
    assert all(json.loads(ln) for ln in metrics.read_text().splitlines())  # no half line


@pytest.mark.slow
def test_a_disk_that_fills_while_training_ends_in_one_paragraph(tmp_path, tiny_model_dir, small_disk):
    """The run directory on a small disk that a filler takes once training logs: the next metrics.jsonl write
    meets ENOSPC (no checkpoint is due), which is said in one paragraph with the file; every logged line is whole."""
    disk = small_disk("2m")
    path = recipe_file(tmp_path, tiny_model_dir, name="run", train={"max_steps": 5000, "save_steps": 4000},
                       output={"dir": str(disk / "run")})
    proc = delft("train", path)
    assert wait_until(proc, lambda: (disk / "run" / METRICS).is_file())
    fill(disk)
    code, out = finished(proc)
    one_paragraph(out)
    assert code == 2, out
    assert "disk is full" in out and METRICS in out and "Free some space" in out, out
    assert all(json.loads(ln) for ln in (disk / "run" / METRICS).read_text().splitlines())


# A GRPO stage as small as the SFT run of recipe_file: two steps, two samples of four tokens per prompt.
GRPO_SECTIONS = {"train": {"stage": "grpo", "batch_size": 2, "grad_accum": 1},
                 "grpo": {"num_generations": 2, "max_completion_length": 4}}


@pytest.mark.slow
def test_a_disk_that_fills_at_the_final_save_ends_in_the_same_paragraph_for_each_stage(tmp_path, tiny_model_dir,
                                                                                      small_disk, monkeypatch):
    """The disk fills just as the final model is written, after its free-space check passed: the SFT loop and TRL's
    real GRPO trainer end in the same one paragraph, leave no half-written final files, and once space is freed
    the same command finishes the run."""
    pytest.importorskip("trl")
    from rich.console import Console

    from delft.recipe.files import load_recipe
    from delft.training import run as lifecycle
    from delft.training.stages import run_training

    checked = lifecycle.check_free_space
    said = {}
    for stage, sections in {"sft": {}, "grpo": GRPO_SECTIONS}.items():
        disk = small_disk("64m")
        monkeypatch.setattr(lifecycle, "check_free_space", lambda *a, disk=disk: (checked(*a), fill(disk)))
        train = {"max_steps": 2, "save_steps": 1, **sections.get("train", {})}
        path = recipe_file(tmp_path, tiny_model_dir, name=stage, **{**sections, "train": train},
                           output={"dir": str(disk / "run")})
        with pytest.raises(UserError) as full:
            run_training(load_recipe(path), console=Console(quiet=True))
        said[stage] = str(full.value).replace(str(disk), "DISK")
        run = disk / "run"
        assert not (run / ".final-tmp").exists() and not (run / "adapter_model.safetensors").exists()
        assert read_info(run)["status"] == "running" and latest_checkpoint(run) is not None
        monkeypatch.undo()
        (disk / "filler").unlink()
        run_training(load_recipe(path), console=Console(quiet=True))
        assert read_info(run)["status"] == "completed" and (run / "adapter_model.safetensors").is_file()
    assert said["sft"] == said["grpo"], said
    assert "disk is full" in said["sft"] and "Free some space" in said["sft"] and "\n" not in said["sft"]


@pytest.mark.parametrize("size", ["40k", "76k", "200k"])  # refused before, full while writing, room enough
def test_export_on_a_small_disk_is_one_paragraph_and_leaves_nothing(tmp_path, tiny_model_dir, small_disk, size):
    """The merged model (52 KB) and its tokenizer on disks that run out in the weights, the tokenizer's Rust
    writer or the reports: one paragraph, exit 2, the disk as empty as before; or, with room, the export."""
    run = lora_run(tiny_model_dir, tmp_path / "run")
    disk = small_disk(size)
    r = run_cli("export", run, "--out", disk / "merged")
    if r.exit_code == 0:
        assert (disk / "merged" / "tokenizer.json").is_file()
        return
    one_paragraph(r.output)
    assert r.exit_code == 2, r.output
    assert "No space left on device" in r.output or "disk is full" in r.output or "free" in r.output, r.output
    assert list(disk.iterdir()) == []


def test_a_stop_caught_inside_code_run_by_pyrun_still_exits_with_delfts_code(tmp_path):
    """CPython flags a KeyboardInterrupt raised in code it runs through PyRun_* (a C extension importing) as
    unhandled even once caught, and a `python -m` run then exits by SIGINT (-2) instead of its own code: the flake
    seen in CI on SIGTERM in export. delft's entry point clears the flag when its command ended by an exit code."""
    flag = "import ctypes, sys\nctypes.pythonapi.PyRun_SimpleString(b'raise KeyboardInterrupt')  # caught there\n"
    (tmp_path / "bare.py").write_text(flag + "sys.exit(3)\n")
    (tmp_path / "flagged.py").write_text(  # the flag set inside a command, which then ends with a user error
        "import ctypes, sys\nimport delft.cli\nreported = delft.cli._reported\n"
        "def flagged(*args, **kwargs):\n"
        "    try:\n"
        "        return reported(*args, **kwargs)\n"
        "    finally:  # after the command's own imports, which may run PyRun_* themselves (and clear it)\n"
        "        ctypes.pythonapi.PyRun_SimpleString(b'raise KeyboardInterrupt')\n"
        "delft.cli._reported = flagged\nsys.argv = ['delft', 'eval']\ndelft.cli.main()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    bare = subprocess.run([sys.executable, "-m", "bare"], capture_output=True, env=env, cwd=tmp_path)
    assert bare.returncode == -signal.SIGINT  # the interpreter's behaviour the fix is for
    done = subprocess.run([sys.executable, "-m", "flagged"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 2 and "delft eval" in done.stderr, (done.returncode, done.stdout, done.stderr)
