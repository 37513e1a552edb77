"""One training per run directory whatever its spelling (a symlinked alias, a bind mount), a lock file never
written through a planted link, and what a kill -9 left half-written removed by the next command (only a dead
process's)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import adapter_weights, interrupt_on_step, recipe_file, run_cli

from delft.recipe.files import load_recipe
from delft.rundir import CHECKPOINTS, LOCK_FILE, METRICS, RECIPE, RUN_INFO, SNAPSHOTS, read_info
from delft.training.stages import run_training


def logged_steps(run: Path) -> int:
    try:
        return sum(1 for ln in (run / METRICS).read_text().splitlines() if '"loss"' in ln)
    except OSError:
        return 0


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (no process has it now)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def one_paragraph(output: str) -> None:
    assert "Traceback" not in output and len([ln for ln in output.splitlines() if ln.strip()]) <= 3, output


# ----------------------------------------------------------------------------- a running run, reached another way


@pytest.fixture(scope="module")
def running(tiny_model_dir, tmp_path_factory):
    """(recipe, run dir, process): `delft train` in its own process, far from its first checkpoint, running
    for the whole module; its files as they were once it had logged a step."""
    tmp = tmp_path_factory.mktemp("running")
    path = recipe_file(tmp, tiny_model_dir, name="run", train={"max_steps": 5000, "save_steps": 4000,
                                                                "eval_steps": 5000})
    proc = subprocess.Popen([sys.executable, "-m", "delft", "train", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run = tmp / "run"
    deadline = time.monotonic() + 300
    while logged_steps(run) < 1:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the training logged no step in 300 s"
        time.sleep(0.1)
    yield path, run, proc
    proc.kill()
    proc.communicate()


def bind_mount(source: Path, target: Path) -> None:
    target.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        target.rmdir()
        pytest.skip(f"mount --bind is not permitted in this sandbox ({done.stderr.strip() or done.returncode}); "
                    "the symlinked alias covers the same lock")


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("alias", ["symlink", "bind-mount"])
def test_a_second_train_through_another_path_is_refused(running, tmp_path, alias, force):
    path, run, proc = running
    other = tmp_path / "other"
    if alias == "symlink":
        other.symlink_to(run, target_is_directory=True)
    else:
        bind_mount(run, other)
    try:
        before = logged_steps(run)
        res = run_cli("train", path, "--set", f"output.dir={other}", *(["--force"] if force else []))
        assert res.exit_code == 2, res.output
        assert f"another delft train (pid {proc.pid}) is writing to {other}" in res.output
        assert "starting over" not in res.output and "replacing" not in res.output
        one_paragraph(res.output)
        assert proc.poll() is None  # the first run goes on, with every file it had
        for name in (RUN_INFO, METRICS, RECIPE, LOCK_FILE):
            assert (run / name).is_file(), name
        assert read_info(run)["status"] == "running"
        assert (run / LOCK_FILE).read_text().strip() == str(proc.pid)
        time.sleep(1)
        assert logged_steps(run) >= before
    finally:
        if alias == "bind-mount" and other.is_dir():
            subprocess.run(["umount", str(other)], check=True)


# ----------------------------------------------------------------------------- a planted lock file


@pytest.mark.parametrize("plant, said", [
    ("symlink", "is a symbolic link"),
    ("dangling symlink", "is a symbolic link"),
    ("hard link", "is a hard link"),
])
def test_a_planted_lock_file_is_refused_and_its_target_unchanged(tmp_path, tiny_model_dir, plant, said):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    if plant == "symlink":
        (run / LOCK_FILE).symlink_to(victim)
    elif plant == "dangling symlink":
        victim.unlink()
        (run / LOCK_FILE).symlink_to(victim)
    else:
        os.link(victim, run / LOCK_FILE)
    res = run_cli("train", recipe_file(tmp_path, tiny_model_dir))
    assert res.exit_code == 2, res.output
    assert f"{run / LOCK_FILE} {said}" in res.output and "delft does not write through it" in res.output
    one_paragraph(res.output)
    if plant == "dangling symlink":
        assert not victim.exists()  # not created through the link
    else:
        assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # nothing else written


def test_a_lock_symlink_beside_the_run_is_not_written_through(tmp_path, tiny_model_dir):
    """The old place of the lock (``.NAME.lock`` beside the run): a link planted there is no longer touched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".run.lock").symlink_to(victim)
    res = run_cli("train", recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 1, "eval_steps": 1}))
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "precious\n"
    assert read_info(tmp_path / "run")["status"] == "completed" and not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_refused_recipe_leaves_no_directory_behind(tmp_path, tiny_model_dir):
    """The lock makes the run directory; a run refused during setup removes it again (it made it, it is empty)."""
    path = recipe_file(tmp_path, tiny_model_dir, data={"max_length": 9})  # refused once the data has loaded
    res = run_cli("train", path)
    assert res.exit_code == 2 and "labels masked" in res.output, res.output
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- leftovers of a kill -9


@pytest.mark.slow
def test_a_resume_removes_a_dead_process_s_leftovers_only(tmp_path, tiny_model_dir, monkeypatch):
    straight = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight")))
    path = recipe_file(tmp_path, tiny_model_dir, name="run")
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    restore()
    run = tmp_path / "run"
    dead, live = dead_pid(), subprocess.Popen(["sleep", "300"])
    try:
        gone = [run / CHECKPOINTS / f".step-000006.tmp-{dead}", run / f".{RUN_INFO}.tmp-{dead}",
                run / SNAPSHOTS / f".step-000002.tmp-{dead}"]
        kept = [run / SNAPSHOTS / f".step-000003.tmp-{live.pid}", run / SNAPSHOTS / f".step-000005.tmp-{os.getpid()}",
                run / SNAPSHOTS / "step-000001"]
        for p in gone + kept:
            p.mkdir(parents=True) if "json" not in p.name else p.write_text('{"status": "half')
        (run / CHECKPOINTS / f".step-000006.tmp-{dead}" / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        res = run_cli("train", path)
    finally:
        live.kill()
        live.wait()
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "leftover" in ln)
    assert f"Removed 3 half-written leftovers of a killed delft (process {dead}, no longer running)" in line
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)
    assert "Resuming" in res.output
    a, b = adapter_weights(straight), adapter_weights(run)  # the resume is the uninterrupted run's
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_leftovers_in_a_folder_that_is_no_run_are_not_touched(tmp_path, tiny_model_dir):
    """Only a delft run directory is swept: in a folder of other files, a refusal and nothing removed."""
    run = tmp_path / "run"
    run.mkdir()
    theirs = run / f".notes.tmp-{dead_pid()}"
    theirs.write_text("mine")
    res = run_cli("train", recipe_file(tmp_path, tiny_model_dir))
    assert res.exit_code == 2 and "already exists" in res.output, res.output
    assert theirs.read_text() == "mine"
