"""Data-parallel training (delft.training.distributed): real torchrun subprocesses on the CPU (gloo), tiny models."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import adapter_weights, assert_same_after_adam, recipe_file, run_cli

# The equivalence tolerance docs/distributed.md#several-gpus quotes: summing two ranks' gradients adds them in another order than
# one process accumulating them, so the adapters agree to float32 rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


def torchrun(recipe: Path, *args: str, nproc: int = 2, **popen) -> subprocess.Popen:
    """``python -m torch.distributed.run --nproc-per-node N -m delft train RECIPE``, as a user would start it."""
    return start([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                  "-m", "delft", "train", str(recipe), *args], **popen)


def accelerate(recipe: Path, nproc: int = 2) -> subprocess.Popen:
    """``accelerate launch --multi_gpu --num_processes N -m delft train RECIPE``: on a machine without GPUs
    accelerate still starts N processes through torch.distributed.run, and delft picks gloo."""
    return start([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
                  "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
                  "-m", "delft", "train", str(recipe)])


def start(cmd: list[str], **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DELFT_DIST_TIMEOUT": "120"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finished(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def assert_same_adapter(a_dir: Path, b_dir: Path, steps: int) -> None:
    a, b = adapter_weights(a_dir), adapter_weights(b_dir)
    assert a.keys() == b.keys()
    assert any(bool(v.abs().sum() > 0) for k, v in a.items() if "lora_B" in k)  # training moved the adapter
    for k in a:  # helpers.recipe_file's learning rate
        assert_same_after_adam(a[k], b[k], lr=1e-2, steps=steps, rtol=RTOL, atol=ATOL, what=k)


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < end, f"no {what} within {timeout} s"
        time.sleep(0.2)


def training_workers(tmp_path: Path, model_dir: Path, name: str, max_steps: int) -> tuple[subprocess.Popen, list[int]]:
    """A 2-process torchrun run that has written its first checkpoint, and its two workers' pids."""
    from delft.rundir import checkpoints

    recipe = recipe_file(tmp_path, model_dir, name=name, train={"max_steps": max_steps, "save_steps": 2,
                                                                "eval_steps": max_steps + 1})
    proc = torchrun(recipe)
    wait_for(lambda: len(checkpoints(tmp_path / name)) > 0, proc, "a checkpoint")
    return proc, [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]


# ----------------------------------------------------------------------------- fast: the pieces


def test_each_rank_takes_a_disjoint_share_of_every_optimizer_batch(monkeypatch):
    from delft.training import distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    shares = {}
    for r in (0, 1):
        monkeypatch.setenv("RANK", str(r))
        shares[r] = [dist.micro_indices(step, 3) for step in range(2)]
    assert shares[0] == [[0, 1, 2], [6, 7, 8]] and shares[1] == [[3, 4, 5], [9, 10, 11]]


def test_schedule_counts_optimizer_batches_of_all_ranks(tmp_path, tiny_model_dir):
    from delft.recipe.files import load_recipe
    from delft.training.schedule import make_schedule

    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"max_steps": None, "epochs": 1,
                                                                      "grad_accum": 2}))
    assert make_schedule(recipe, 40, 1).total_steps == 5
    assert make_schedule(recipe, 40, 2).total_steps == 3  # 10 micro-batches, 4 per optimizer step


def test_nproc_is_stripped_before_relaunch():
    from delft.training.launch import strip_nproc

    assert strip_nproc(["train", "r.yaml", "--nproc", "2", "--force", "--nproc=3"]) == ["train", "r.yaml", "--force"]


def test_resume_with_another_world_size_needs_the_same_global_batch(tmp_path, tiny_model_dir, monkeypatch):
    from rich.console import Console

    from delft.errors import UserError
    from delft.recipe.files import load_recipe
    from delft.training.resume import check_resume

    saved = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="a", train={"grad_accum": 2}))
    same_global = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="b", train={"grad_accum": 1}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    console = Console(record=True, width=200)
    assert check_resume({"world_size": 1}, saved, same_global, ["train.grad_accum"], console) == []
    assert "instead of 1" in console.export_text()
    assert check_resume({"world_size": 2}, saved, same_global, ["train.grad_accum"], console) == ["train.grad_accum"]
    with pytest.raises(UserError, match="global batch") as e:
        check_resume({"world_size": 1}, saved, saved, [], console)
    assert "train.grad_accum=1" in str(e.value)


def test_ranks_of_the_test_batch_hold_different_digit_counts(tmp_path, tiny_model_dir, monkeypatch):
    """The equivalence below is only a test of the count all-reduce if the ranks' shares differ in digits."""
    from delft.data.batches import collate
    from delft.recipe.files import load_recipe
    from delft.training.distributed import micro_indices
    from delft.training.schedule import make_schedule, micro_batch_items
    from delft.training.setup import setup
    from delft.training.step import targets

    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir, lora={"dropout": 0.0}))
    s = setup(recipe)
    schedule = make_schedule(recipe, len(s.train), 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    digits = []
    for r in (0, 1):
        monkeypatch.setenv("RANK", str(r))
        items = micro_batch_items(s.train, recipe, schedule, micro_indices(0, recipe.train.grad_accum)[0])
        digits.append(s.loss.count(targets(collate(items, s.tokenizer.pad_token_id))).digits)
    assert digits[0] != digits[1]


# ----------------------------------------------------------------------------- slow: real torchrun runs


LOGGED = ("loss", "ce", "term", "digit_logit", "p_digit", "val_loss", "val_ce", "val_term")


@pytest.mark.slow
@pytest.mark.parametrize("launch,normalisation", [(torchrun, "global"), (accelerate, "global"),
                                                  (torchrun, "reference")],
                         ids=["torchrun", "accelerate", "torchrun-reference"])
def test_two_processes_equal_one_process_on_the_same_global_batch(tmp_path, tiny_model_dir, launch, normalisation):
    from delft.recipe.files import load_recipe
    from delft.rundir import read_info
    from delft.training.stages import run_training

    common = {"max_steps": 4, "save_steps": 2, "eval_steps": 2}
    loss = {"type": "del_prob", "weight": 0.5, "normalisation": normalisation}
    one = recipe_file(tmp_path, tiny_model_dir, name="one", lora={"dropout": 0.0}, loss=loss,
                      train={**common, "grad_accum": 2})
    two = recipe_file(tmp_path, tiny_model_dir, name="two", lora={"dropout": 0.0}, loss=loss,
                      train={**common, "grad_accum": 1})
    proc = launch(two)
    run_training(load_recipe(one))
    out = finished(proc)
    assert_same_adapter(tmp_path / "one", tmp_path / "two", steps=4)
    assert read_info(tmp_path / "two")["world_size"] == 2 and "on 2 processes" in out
    rows = [json.loads(ln) for ln in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(ln) for ln in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in ref]  # rank 0 alone wrote the log, once per step
    seen = set()
    for r, q in zip(rows, ref):
        assert set(r) == set(q)
        for key in LOGGED:
            if key in q:
                seen.add(key)
                assert q[key] is not None and q[key] != 0, (key, q)  # a field that could be dropped is not 0
                assert r[key] == pytest.approx(q[key], rel=1e-5), (key, r["step"], r[key], q[key])
    assert seen == set(LOGGED)
    assert out.count("done adapter") == 1  # the other rank is silent


@pytest.mark.slow
def test_ctrl_c_on_the_launcher_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir):
    from delft.rundir import checkpoints

    train = {"max_steps": 12, "save_steps": 2, "eval_steps": 100}
    straight = recipe_file(tmp_path, tiny_model_dir, name="straight", train=train)  # dropout 0.1: RNG per rank
    cut = recipe_file(tmp_path, tiny_model_dir, name="cut", train=train)
    proc = torchrun(cut, start_new_session=True)
    wait_for(lambda: len(checkpoints(tmp_path / "cut")) > 0, proc, "a checkpoint")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the launcher and every rank get it
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    assert checkpoints(tmp_path / "cut"), out[-3000:]
    finished(torchrun(straight))
    out = finished(start([sys.executable, "-m", "delft", "train", str(cut), "--nproc", "2"]))  # torchrun again
    assert "Resuming" in out and "on 2 processes" in out
    assert_same_adapter(tmp_path / "straight", tmp_path / "cut", steps=12)


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_keeps_the_checkpoint(tmp_path, tiny_model_dir):
    from delft.rundir import STATE_FILE, checkpoints

    proc, workers = training_workers(tmp_path, tiny_model_dir, "killed", max_steps=400)
    rank1 = [p for p in workers if b"RANK=1" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
    assert rank1, workers
    os.kill(int(rank1[0]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)  # bounded: the launcher stops rank 0 instead of letting it hang
    assert proc.returncode != 0
    assert "rank" in out and ": 1 (local_rank: 1)" in out, out[-3000:]  # torchrun's summary names the dead rank
    last = checkpoints(tmp_path / "killed")[-1]
    state = torch.load(last / STATE_FILE, weights_only=False)
    assert state["step"] == int(last.name.split("-")[-1])


def test_plan_per_gpu_adds_only_nccl_buffers_for_several_processes(tmp_path, tiny_model_dir):
    from rich.console import Console

    from delft.recipe.files import load_recipe
    from delft.planning.memory import NCCL_BUFFERS
    from delft.planning.command import run_plan

    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir))
    console = Console(record=True, width=200)
    one = run_plan(recipe, "8GiB", console)["components"]
    two = run_plan(recipe, "8GiB", console, world_size=2)["components"]
    assert two["total"] == one["total"] + NCCL_BUFFERS
    assert {k: v for k, v in two.items() if k not in ("total", "nccl_buffers")} == \
        {k: v for k, v in one.items() if k != "total"}
    text = console.export_text()
    assert "NCCL buffers" in text and "per GPU of 2 processes" in text


def test_cli_plan_takes_a_world_size(tmp_path, tiny_model_dir):
    r = run_cli("recipe", "check", str(recipe_file(tmp_path, tiny_model_dir)), "--plan", "--world-size", "4")
    assert r.exit_code == 0, r.output
    assert "per GPU of 4 processes" in r.output


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker_behind(tmp_path, tiny_model_dir):
    """kill -9 of torchrun's launcher: its workers die with it (they asked the kernel to), none trains on."""
    proc, workers = training_workers(tmp_path, tiny_model_dir, "orphans", max_steps=100000)
    assert len(workers) == 2, workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    end = time.monotonic() + 30
    while time.monotonic() < end and any(Path(f"/proc/{w}").exists() and _alive(w) for w in workers):
        time.sleep(0.5)
    left = [w for w in workers if Path(f"/proc/{w}").exists() and _alive(w)]
    for w in left:  # do not leave them to the rest of the suite
        os.kill(w, signal.SIGKILL)
    assert not left, "workers outlived the launcher"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_more_processes_than_devices_are_refused_before_any_launch(tmp_path, tiny_model_dir, monkeypatch):
    from helpers import run_cli

    import delft.training.command as train_command

    monkeypatch.setattr(train_command, "relaunch", lambda *a: (_ for _ in ()).throw(AssertionError("launched")))
    recipe = recipe_file(tmp_path, tiny_model_dir, name="many", model={"device": "cpu"})
    r = run_cli("train", recipe, "--nproc", str((os.cpu_count() or 1) + 62))
    assert r.exit_code == 2 and "more processes than this machine has devices" in " ".join(r.output.split()), r.output
    assert "--oversubscribe" in r.output and not (tmp_path / "many").exists()
    with pytest.raises(AssertionError, match="launched"):  # asked for explicitly: it would launch
        run_cli("train", recipe, "--nproc", "64", "--oversubscribe", catch_exceptions=False)


@pytest.mark.slow
def test_a_user_error_under_nproc_is_printed_once_with_exit_2(tmp_path, tiny_model_dir):
    """The workers' refusal reaches the user once, as in one process, without torchrun's traceback."""
    (tmp_path / "taken").write_text("a file where the run directory should go")
    recipe = recipe_file(tmp_path, tiny_model_dir, name="x", output={"dir": str(tmp_path / "taken")})
    proc = start([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "2"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    assert out.count("error:") == 1 and str(tmp_path / "taken") in out, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
