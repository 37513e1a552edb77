"""Bad input to `delft train` (recipes, data, run directories, interrupts, kills): a clear refusal or an exact
recovery, never a traceback and never a lost or mixed-up run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import adapter_weights, read_only_dir, recipe_file

import delft.training.report as train_report
import delft.training.step as train_step
from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.rundir import CHECKPOINTS, METRICS, RUN_INFO, checkpoints, latest_checkpoint, read_info
from delft.training.stages import run_training


def write(tmp_path: Path, text, name="r.yaml") -> Path:
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


# ----------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("text, message", [
    ("train:\n  learning_rate: yes\n", "learning_rate got the YAML boolean True"),
    ("train:\n  max_steps: no\n", "max_steps got the YAML boolean False"),
    ("train:\n  learning_rate: .inf\n", "learning_rate: Input should be a finite number"),
    ("loss:\n  weight: .nan\n", "loss.weight: Input should be a finite number"),
    ("", "empty recipe"),
    ("# only a comment\n", "empty recipe"),
    ("train:\n  seed: 1\n  batch_size: 2\n  seed: 2\n", "key 'seed' appears twice \\(lines 2 and 4\\)"),
    (b"train:\n  seed: 1\n\xff\xfe\x00\x01", "not a text \\(UTF-8\\) file: byte 0xff at line 3"),
    (b"train: {}\n\x00\x00", "binary file"),
])
def test_bad_recipes_are_refused(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        load_recipe(write(tmp_path, text))


def test_fused_loss_on_off_and_home_dir(tmp_path):
    on = load_recipe(write(tmp_path, "train:\n  fused_loss: on\noutput:\n  dir: ~/runs/x\n"))
    assert on.train.fused_loss == "on" and on.output.dir == str(Path.home() / "runs" / "x")
    assert load_recipe(write(tmp_path, "train:\n  fused_loss: off\n")).train.fused_loss == "off"
    assert load_recipe(write(tmp_path, "train:\n  gradient_checkpointing: off\n")).train.gradient_checkpointing is False
    with pytest.raises(UserError, match="learning_rate got the YAML boolean"):
        load_recipe(write(tmp_path, "train: {}\n"), ["train.learning_rate=yes"])


def test_recipe_that_is_a_directory(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        load_recipe(tmp_path)


# ----------------------------------------------------------------------------- data


def data_cfg(source, fmt="prompt_completion", **kw):
    from delft.recipe.schema import DataConfig

    return DataConfig(source=str(source), format=fmt, **kw)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_data_file_with_a_non_utf8_byte_names_file_and_line(tmp_path, suffix):
    from delft.data.pipeline import load_examples

    good = {".jsonl": b'{"prompt": "a", "completion": "1"}\n',
            ".json": b'[{"prompt": "a", "completion": "1"},\n', ".csv": b"prompt,completion\n"}[suffix]
    path = tmp_path / f"d{suffix}"
    path.write_bytes(good + b'{"prompt": "caf\xe9", "completion": "2"}\n')
    with pytest.raises(UserError, match=f"d{suffix} line 2 is not UTF-8 text \\(byte 0xe9\\)"):
        load_examples(data_cfg(path))


def test_a_count_val_size_may_not_take_most_of_the_data(tmp_path, tiny_tokenizer):
    from delft.data.pipeline import build_datasets

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1", "completion": str(i + 1)}) + "\n" for i in range(40)))
    with pytest.raises(UserError, match="val_size 32 would take 32 of the 40 usable examples"):
        build_datasets(data_cfg(path, val_size=32), tiny_tokenizer, 0)
    train, val, _ = build_datasets(data_cfg(path, val_size=20), tiny_tokenizer, 0)
    assert (len(train), len(val)) == (20, 20)
    train, val, _ = build_datasets(data_cfg(path, val_size=0.9), tiny_tokenizer, 0)  # a fraction is taken as meant
    assert (len(train), len(val)) == (4, 36)


def test_a_huge_line_is_cut_before_tokenizing_and_counted(tmp_path, tiny_tokenizer):
    from delft.data.batches import CHARS_PER_TOKEN_BUDGET, tokenize_example
    from delft.data.sources import Example
    from delft.data.pipeline import build_datasets

    cfg = data_cfg(tmp_path / "unused.jsonl", max_length=16)
    budget = 16 * CHARS_PER_TOKEN_BUDGET
    calls = []
    real_encode = tiny_tokenizer.encode

    class Watching:  # the real tokenizer, recording how long a text it was asked to encode
        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def encode(self, text, **kw):
            calls.append(len(text))
            return real_encode(text, **kw)

    tok = tokenize_example(Example("1 + " * 200_000, "2"), Watching(), cfg)
    assert tok.truncated and len(tok.input_ids) == 16
    assert max(calls) <= budget
    short = tokenize_example(Example("1 + 1", "2"), tiny_tokenizer, cfg)
    assert not short.truncated
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "9" * 100_000, "completion": "1"}) + "\n"
                    + json.dumps({"prompt": "1 + 1", "completion": "2"}) + "\n")
    _, _, stats = build_datasets(data_cfg(path, max_length=16, val_size=0, train_on_prompt=True), tiny_tokenizer, 0)
    assert stats.truncated == 1


# ----------------------------------------------------------------------------- runs: interrupts, kills, locks


def run_recipe(tmp_path, model_dir, name, **train) -> Path:
    """The runs below: 6 steps of 2 micro-batches, LoRA dropout 0.1, checkpoints every 3 steps."""
    return recipe_file(tmp_path, model_dir, name=name, train={"grad_accum": 2, **train})


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory) -> dict:
    """The adapter of an uninterrupted run, to compare every recovered run against."""
    tmp = tmp_path_factory.mktemp("straight")
    return adapter_weights(run_training(load_recipe(run_recipe(tmp, tiny_model_dir, "straight"))))


def assert_same_adapter(expected: dict, run_dir: Path) -> None:
    got = adapter_weights(run_dir)
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-5)


def interrupt_in_forward(monkeypatch, at_call: int) -> None:
    """Ctrl-C inside the at_call-th training forward pass, after its dropout has drawn random numbers."""
    real, calls = train_step.forward_sums, {"n": 0}

    def forward(model, batch, loss):
        out = real(model, batch, loss)
        if model.training:
            calls["n"] += 1
            if calls["n"] == at_call:
                raise KeyboardInterrupt
        return out

    monkeypatch.setattr(train_step, "forward_sums", forward)


def test_ctrl_c_inside_a_step_with_dropout_resumes_exactly(tmp_path, tiny_model_dir, straight, monkeypatch):
    path = run_recipe(tmp_path, tiny_model_dir, "run")
    interrupt_in_forward(monkeypatch, at_call=2 * 4 + 2)  # the 2nd micro-batch of step 5
    with pytest.raises(SystemExit) as e:
        run_training(load_recipe(path))
    assert e.value.code == 130
    assert latest_checkpoint(tmp_path / "run").name == "step-000004"
    monkeypatch.undo()
    run_training(load_recipe(path))
    assert_same_adapter(straight, tmp_path / "run")


def test_damaged_checkpoint_falls_back_to_an_older_one(tmp_path, tiny_model_dir, straight, monkeypatch):
    path = run_recipe(tmp_path, tiny_model_dir, "run")
    interrupt_in_forward(monkeypatch, at_call=2 * 4 + 1)
    old_mask = os.umask(0o022)
    try:
        with pytest.raises(SystemExit):
            run_training(load_recipe(path))
    finally:
        os.umask(old_mask)
    run = tmp_path / "run"
    assert [c.name for c in checkpoints(run)] == ["step-000003", "step-000004"]
    weights = latest_checkpoint(run) / "adapter_model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o644  # the umask, not safetensors' 0600
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with open(run / METRICS, "a") as f:
        f.write('{"step": 4, "lo')  # half-written by a killed run
    monkeypatch.undo()
    console, out = captured_console()
    run_training(load_recipe(path), console=console)
    said = out.getvalue()
    assert "step-000004 cannot be read" in said and "trying an older one" in said
    assert "dropped a half-written last line" in said
    assert_same_adapter(straight, run)
    steps = [json.loads(ln)["step"] for ln in (run / METRICS).read_text().splitlines() if '"loss"' in ln]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_resume_never_finishes_a_run_past_its_steps(tmp_path, tiny_model_dir, monkeypatch):
    path = run_recipe(tmp_path, tiny_model_dir, "run")
    interrupt_in_forward(monkeypatch, at_call=2 * 4 + 1)  # in step 5 of 6: checkpoints at steps 3 and 4
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    monkeypatch.undo()
    run = tmp_path / "run"
    kept, log = [c.name for c in checkpoints(run)], (run / METRICS).read_text()
    assert kept == ["step-000003", "step-000004"]
    # fewer steps than the checkpoint's (max_steps, before any model loads; or the total train.epochs gives)
    for sets in (["train.max_steps=3"], ["train.max_steps=null", "train.epochs=0.2"]):
        with pytest.raises(UserError) as e:
            run_training(load_recipe(path, sets))
        msg = " ".join(str(e.value).split())
        assert "step-000004 is at step 4, but this recipe trains" in msg and "without training" in msg
        assert "--set train.max_steps=4" in msg and "--force to start the run over" in msg
        assert [c.name for c in checkpoints(run)] == kept and (run / METRICS).read_text() == log
        assert read_info(run)["status"] == "interrupted" and read_info(run)["step"] == 4
    # raising max_steps still resumes and trains on to the new end
    run_training(load_recipe(path, ["train.max_steps=8"]))
    info = read_info(run)
    assert info["status"] == "completed" and info["step"] == 8 and checkpoints(run) == []
    steps = [json.loads(ln)["step"] for ln in (run / METRICS).read_text().splitlines() if '"loss"' in ln]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]


def train_process(recipe: Path, *extra: str) -> subprocess.Popen:
    """`python -m delft train RECIPE` as a user runs it, in its own process."""
    return subprocess.Popen([sys.executable, "-m", "delft", "train", str(recipe), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "300"})


def wait_for(proc: subprocess.Popen, ready, timeout: float = 240.0) -> bool:
    """Poll until ``ready()`` (True) or the process ended (False); bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        if proc.poll() is not None:
            return ready()
        time.sleep(0.002)
    proc.kill()
    raise AssertionError("the training did not reach the expected point in time")


def logged_steps(run: Path) -> int:
    try:
        return sum(1 for ln in (run / METRICS).read_text().splitlines() if '"loss"' in ln)
    except OSError:
        return 0


def long_run(tmp_path, model_dir, name: str, logged: int):
    """(recipe, run dir, process): a training far from its first checkpoint, once it has logged ``logged`` steps."""
    path = recipe_file(tmp_path, model_dir, name=name, train={"max_steps": 5000, "save_steps": 4000})
    proc = train_process(path)
    try:
        assert wait_for(proc, lambda: logged_steps(tmp_path / name) >= logged)
    except BaseException:
        proc.kill()
        raise
    return path, tmp_path / name, proc


def captured_console():
    import io

    from rich.console import Console

    out = io.StringIO()
    return Console(file=out, width=300), out


def test_sigterm_saves_and_a_second_training_is_refused(tmp_path, tiny_model_dir):
    path, run, proc = long_run(tmp_path, tiny_model_dir, "my run", logged=2)
    try:
        with pytest.raises(UserError, match=f"another delft train \\(pid {proc.pid}\\) is writing to"):
            run_training(load_recipe(path))
        before = run / METRICS
        assert logged_steps(run) >= 2 and before.is_file()  # the refused one touched nothing
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    assert "Stopped (SIGTERM)." in out
    assert f"Resume with: delft train '{path}'" in out  # shell-quoted: the path has a space
    assert read_info(run)["status"] == "interrupted"
    assert latest_checkpoint(run) is not None
    assert not (run / ".delft.lock").exists()  # the lock file: a clean stop deletes it


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path, tiny_model_dir):
    path, run, proc = long_run(tmp_path, tiny_model_dir, "run", logged=1)
    proc.kill()
    proc.communicate()
    assert read_info(run)["status"] == "running" and latest_checkpoint(run) is None
    console, out = captured_console()
    run_training(load_recipe(path, ["train.max_steps=2"]), console=console)
    said = out.getvalue()
    assert f"holds a run (pid {proc.pid}) that stopped before its first checkpoint: starting over" in said
    assert read_info(run)["status"] == "completed" and logged_steps(run) == 2


@pytest.mark.slow
def test_sigkill_anywhere_resumes_to_the_same_adapter(tmp_path, tiny_model_dir, straight):
    """Fault injection: kill -9 at observed file events (a checkpoint being written, a log line, the final
    save), resume each time; the adapter is the uninterrupted run's."""
    path = run_recipe(tmp_path, tiny_model_dir, "run", save_steps=1)
    run = tmp_path / "run"
    root = run / CHECKPOINTS

    def writing_checkpoint():
        return root.is_dir() and any(p.name.startswith(".") and ".tmp-" in p.name for p in root.iterdir())  # staged

    kill_points = [writing_checkpoint, lambda: logged_steps(run) >= 3, writing_checkpoint,
                   lambda: (run / ".final-tmp").exists() or logged_steps(run) >= 6]
    killed = 0
    for ready in kill_points:
        proc = train_process(path)
        try:
            if wait_for(proc, ready):
                proc.kill()
                killed += proc.wait() == -signal.SIGKILL
        finally:
            proc.kill()
            proc.communicate()
        if read_info(run).get("status") == "completed":
            break
    assert killed >= 2
    if read_info(run).get("status") != "completed":
        proc = train_process(path)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    assert_same_adapter(straight, run)


def test_loss_curve_axis_is_not_set_by_the_first_points():
    low, high = train_report.loss_axis_limits([9.9, 7.0] + [1.0 + 0.01 * i for i in range(60)])
    assert low == 0 and 1.5 < high < 2.5
    assert train_report.loss_axis_limits([]) == (0.0, 1.0)


def test_output_dir_in_a_read_only_directory(tmp_path, tiny_model_dir):
    # read_only_dir: mode 0555, and chattr +i as root, so the directory is unwritable for root too
    with read_only_dir(tmp_path / "ro") as locked:
        with pytest.raises(UserError, match=re.escape(f"{locked} is not writable, so the run cannot be saved")):
            run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir), [f"output.dir={locked}/run"]))
        assert list(locked.iterdir()) == []


def test_only_rank_zero_takes_the_lock(tmp_path, monkeypatch):
    from delft.training.lock import lock_path, run_lock

    run = tmp_path / "run"
    with run_lock(run) as first:
        assert first.path == lock_path(run) and first.path.read_text().strip() == str(os.getpid())
        monkeypatch.setenv("RANK", "1")
        with run_lock(run) as other:  # another rank of the same distributed run
            assert other.path is None
    assert not lock_path(run).exists()


def test_run_dir_under_a_file_and_a_corrupt_run_info(tmp_path, tiny_model_dir):
    (tmp_path / "afile").write_text("x")
    path = recipe_file(tmp_path, tiny_model_dir)
    with pytest.raises(UserError, match="is a file, so"):
        run_training(load_recipe(path, [f"output.dir={tmp_path}/afile/run"]))
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_INFO).write_text('{"status": "runn')
    with pytest.raises(UserError, match=f"{RUN_INFO} cannot be read"):
        run_training(load_recipe(path))


def test_model_cache_conversion_keeps_a_copy_another_process_finished(tmp_path, monkeypatch):
    from delft.models.sources import usable_cache_dir
    from delft.outputs import publish
    from delft.rundir import MODEL_CONFIG

    def _publish(tmp, target):  # as the model cache publishes a conversion
        publish(tmp, target, shared=lambda p: (p / MODEL_CONFIG).is_file())

    target = tmp_path / "cache" / "m"
    for who in ("first", "second"):  # two processes converted at once; the first renamed its copy in
        tmp = tmp_path / "cache" / f".tmp-{who}"
        tmp.mkdir(parents=True)
        (tmp / MODEL_CONFIG).write_text(who)
        _publish(tmp, target)
        assert not tmp.exists()
    assert (target / MODEL_CONFIG).read_text() == "first"
    leftover = tmp_path / "cache" / "half"
    leftover.mkdir()  # a killed conversion's partial copy is replaced
    tmp = tmp_path / "cache" / ".tmp-third"
    tmp.mkdir()
    (tmp / MODEL_CONFIG).write_text("third")
    _publish(tmp, leftover)
    assert (leftover / MODEL_CONFIG).read_text() == "third"
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("DELFT_CACHE", str(tmp_path / "afile" / "cache"))
    with pytest.raises(UserError, match="DELFT_CACHE.*cannot be used"):
        usable_cache_dir()
