"""Sharded checkpoints read as data only (delft.training.sharded_checkpoints): code planted in DCP's ``.metadata`` or in
a non-tensor item of a ``.distcp`` is refused before it runs (torch's own reader runs it: checked here too), a damaged
newest checkpoint falls back to an older intact one, and a disk that fills during ``dcp.save`` is one paragraph."""

import dataclasses
import io
import json
import operator
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import recipe_file
from test_distributed import start
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from delft import rundir
from delft.errors import UserError
from delft.training import sharded_checkpoints as sc


class Command:
    """Unpickled, runs ``cmd`` in a shell (what an attacker plants)."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class ThenReturn:
    """Unpickled, runs ``cmd`` and then gives back ``value``: the planted file still loads, nothing looks wrong."""

    def __init__(self, cmd: str, value):
        self.cmd, self.value = cmd, value

    def __reduce__(self):
        return operator.itemgetter(1), ((Command(self.cmd), self.value),)


def touch(marker: Path) -> str:
    return f"touch {marker}"


def write_checkpoint(ckpt: Path) -> None:
    """A real DCP checkpoint in delft's layout, written by one process: weights, an optimizer state and its
    non-tensor param groups (DCP stores those as pickled bytes items), sharded.json and the trainer state."""
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)},
             "optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}},
                           "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["w"]}]}}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / sc.SHARDED_MARK).write_text(json.dumps({"world_size": 1}))
    torch.save({"step": 4, "optimizer": sc.SHARDED_MARK, "scheduler": {}, "rng": {}, "extra": {}},
               ckpt / rundir.STATE_FILE)


def template() -> dict:
    return {"model": {"w": torch.zeros(3, 4)},
            "optimizer": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3, 4)}},
                          "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]}}


def plant_in_metadata(ckpt: Path, marker: Path) -> None:
    """``.metadata`` rewritten as the genuine index wrapped in a payload that runs a command first."""
    genuine = pickle.loads((ckpt / sc.METADATA).read_bytes())  # our own file: trusted here
    (ckpt / sc.METADATA).write_bytes(pickle.dumps(ThenReturn(touch(marker), genuine)))


def plant_in_bytes_item(ckpt: Path, marker: Path) -> None:
    """One non-tensor item (an optimizer setting) replaced by a pickle that runs a command and returns the genuine
    value: appended to the rank-0 data file, and the genuine index pointed at it."""
    metadata = pickle.loads((ckpt / sc.METADATA).read_bytes())
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if type(metadata.state_dict_metadata[i.fqn]).__name__ == "BytesStorageMetadata")
    data = ckpt / info.relative_path
    with open(data, "rb") as f:
        f.seek(info.offset)
        value = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    payload = io.BytesIO()
    torch.save(ThenReturn(touch(marker), value), payload)
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (ckpt / sc.METADATA).write_bytes(pickle.dumps(metadata))


def files(ckpt: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}


def test_planted_metadata_runs_in_torchs_reader_and_is_refused_by_delfts(tmp_path):
    ckpt, marker = tmp_path / "step-000004", tmp_path / "ran"
    write_checkpoint(ckpt)
    plant_in_metadata(ckpt, marker)
    before = files(ckpt)
    with pytest.raises(UserError) as e:
        sc.check(ckpt)
    assert not marker.exists()
    said = str(e.value)
    assert ".metadata" in said and "the global operator.itemgetter" in said and "nothing was deleted" in said and "\n" not in said
    assert files(ckpt) == before
    FileSystemReader(str(ckpt)).read_metadata()  # what torch.distributed.checkpoint.load does with it
    assert marker.exists()  # the plant is real: torch's reader ran it


def test_a_planted_non_tensor_item_runs_in_torchs_planner_and_is_refused_by_delfts(tmp_path):
    ckpt, marker = tmp_path / "step-000004", tmp_path / "ran"
    write_checkpoint(ckpt)
    plant_in_bytes_item(ckpt, marker)
    with pytest.raises(UserError) as e:
        sc.check(ckpt)
    assert not marker.exists() and "holds Python objects" in str(e.value)
    dcp.load(template(), checkpoint_id=str(ckpt), planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()  # torch's default planner unpickled it in full


def test_a_genuine_checkpoint_is_checked_and_loaded_through_delfts_reader_and_planner(tmp_path):
    ckpt = tmp_path / "step-000004"
    write_checkpoint(ckpt)
    metadata, state = sc.check(ckpt)
    assert state["step"] == 4
    loaded = template()
    dcp.load(loaded, storage_reader=sc._CheckedReader(ckpt, metadata), planner=sc._DataOnlyPlanner(ckpt),
             no_dist=True)
    assert torch.equal(loaded["model"]["w"], torch.arange(12.0).reshape(3, 4))
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert loaded["optimizer"]["param_groups"][0]["params"] == ["w"]


@pytest.mark.parametrize("damage,why", [
    (lambda c: (c / sc.METADATA).unlink(), "missing"),
    (lambda c: os.truncate(c / "__0_0.distcp", (c / "__0_0.distcp").stat().st_size // 2), "cut short"),
    (lambda c: (c / "__0_0.distcp").unlink(), "missing"),
    (lambda c: (c / sc.SHARDED_MARK).unlink(), "missing"),
    (lambda c: (c / sc.METADATA).write_bytes(b"\x80\x04garbage"), "cannot be read"),
])
def test_a_damaged_checkpoint_is_damaged_and_still_known_as_sharded(tmp_path, damage, why):
    ckpt = tmp_path / "step-000004"
    write_checkpoint(ckpt)
    damage(ckpt)
    assert sc.is_sharded_checkpoint(ckpt)  # recognised by its files, not only by sharded.json
    with pytest.raises(sc.Damaged, match=why):
        sc.check(ckpt)


def test_an_item_stored_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "step-000004"
    write_checkpoint(ckpt)
    metadata = pickle.loads((ckpt / sc.METADATA).read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../../x")
    (ckpt / sc.METADATA).write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="outside the checkpoint"):
        sc.check(ckpt)


# -- a real 2-rank fsdp run: planted files refused on resume, damaged checkpoints skipped


MAX_STEPS = 40


def interrupted_fsdp_run(tmp_path: Path, model_dir: Path, checkpoints: int) -> tuple[Path, Path]:
    """An fsdp LoRA run on 2 ranks killed (SIGKILL to every process) once it wrote ``checkpoints`` checkpoints:
    (its recipe, its run directory)."""
    # far more steps than it takes to write them: a fast machine must not finish (and drop them) before the kill
    train = {"distributed": "fsdp", "max_steps": MAX_STEPS, "save_steps": 2, "eval_steps": 100,
             "logging_steps": 1, "keep_checkpoints": checkpoints}
    recipe = recipe_file(tmp_path, model_dir, name="run", train=train)
    proc = start([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "2"], start_new_session=True)
    end = time.monotonic() + 600
    while len(rundir.checkpoints(tmp_path / "run")) < checkpoints:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < end
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return recipe, tmp_path / "run"


def resume(recipe: Path) -> tuple[int, str]:
    proc = start([sys.executable, "-m", "delft", "train", str(recipe), "--nproc", "2"])
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


@pytest.mark.slow
def test_planted_checkpoint_files_are_refused_on_every_rank_and_the_run_resumes_once_they_are_back(
        tmp_path, tiny_model_dir):
    recipe, run = interrupted_fsdp_run(tmp_path, tiny_model_dir, checkpoints=2)
    newest = rundir.checkpoints(run)[-1]
    genuine = files(newest)
    for plant in (plant_in_metadata, plant_in_bytes_item):
        marker = tmp_path / f"ran-{plant.__name__}"
        plant(newest, marker)
        planted = files(newest)
        code, out = resume(recipe)
        assert code == 2, out[-3000:]
        assert "Traceback" not in out and "holds Python objects" in out and str(newest) in out, out[-3000:]
        assert not marker.exists()  # on no rank
        assert files(newest) == planted and len(rundir.checkpoints(run)) == 2  # nothing deleted
        for name, data in genuine.items():  # the owner's files back
            (newest / name).write_bytes(data)
        for extra in set(planted) - set(genuine):
            (newest / extra).unlink()
    code, out = resume(recipe)
    assert code == 0, out[-3000:]
    assert "Resuming" in out and rundir.read_info(run)["status"] == rundir.COMPLETED


@pytest.mark.slow
def test_damaged_newest_sharded_checkpoints_fall_back_to_the_older_intact_one(tmp_path, tiny_model_dir):
    recipe, run = interrupted_fsdp_run(tmp_path, tiny_model_dir, checkpoints=3)
    oldest, middle, newest = rundir.checkpoints(run)
    shard = newest / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 3)
    (middle / sc.METADATA).unlink()  # what `cp dir/*` leaves out
    code, out = resume(recipe)
    assert code == 0, out[-3000:]
    flat = " ".join(out.split())
    assert f"checkpoint {newest} cannot be read" in flat and "cut short" in flat, out[-3000:]
    assert f"checkpoint {middle} cannot be read" in flat and "missing" in flat, out[-3000:]
    assert "Traceback" not in out
    steps = [json.loads(ln)["step"] for ln in (run / rundir.METRICS).read_text().splitlines()
             if "loss" in json.loads(ln)]
    assert steps == sorted(steps) and steps[-1] == MAX_STEPS  # resumed from the oldest, the metrics cut back to it
    assert len(steps) == MAX_STEPS


FULL_DISK_WORKER = '''
import sys
from pathlib import Path
sys.path[:0] = {paths!r}
from tiny import save_tiny
from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.training import distributed as dist, sharded_checkpoints as sc
from delft.training.setup import build_model, build_optimizer, setup
from delft.training.sharding import shard
from rich.console import Console

dist.start("cpu")
s = setup(load_recipe(Path({recipe!r})))
model, dtype, _ = build_model(s, Console(quiet=True))
root = shard(model, s.loss, s.recipe, "cpu")
optimizer = build_optimizer(s, [p for p in model.parameters() if p.requires_grad], dtype)
sc.check_free_space = lambda *a: None  # the disk fills after the check passed (another writer): the race itself
try:
    sc.save(Path({run!r}), root, optimizer, {{"step": 2}}, keep=2)
    print("SAVED", flush=True)
except UserError as e:
    print(f"RANK {{dist.rank()}} USERERROR {{e}}", flush=True)
'''


@contextmanager
def tmpfs(where: Path, size: str):
    """A fresh tmpfs of ``size`` mounted at ``where`` (CI and developers run as root, as the full-disk tests need)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    assert mounted.returncode == 0, mounted.stderr
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_disk_that_fills_during_dcp_save_is_one_paragraph_on_every_rank(tmp_path, tiny_model_dir):
    from test_signals_and_full_disks import fill

    with tmpfs(tmp_path / "disk", "256k") as disk:
        recipe = recipe_file(tmp_path, tiny_model_dir, name="run", output={"dir": str(disk / "run")},
                             train={"distributed": "fsdp", "finetuning": "full"})
        (disk / "run").mkdir()
        fill(disk)
        worker = tmp_path / "worker.py"
        tests = str(Path(__file__).resolve().parent.parent)
        worker.write_text(FULL_DISK_WORKER.format(paths=[tests, str(Path(tests).parent)], recipe=str(recipe),
                                                  run=str(disk / "run")))
        proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      str(worker)])
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        said = {rank: out.split(f"RANK {rank} USERERROR ")[1].split("RANK ")[0] for rank in (0, 1)}
        assert "SAVED" not in out, out[-3000:]
        assert all("disk is full" in s and "Free some space" in s for s in said.values()), said
        assert not list((disk / "run" / "checkpoints").iterdir())  # the staged directory removed, nothing published


def test_a_small_volume_that_holds_the_run_trains_to_the_end(tmp_path, tiny_model_dir):
    """The final files' free-space check asks for what will be written (the weights and the tokenizer), not a fixed
    16 MiB: a run whose files fit in 3 MiB finishes there."""
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    with tmpfs(tmp_path / "disk", "3m") as disk:
        recipe = recipe_file(tmp_path, tiny_model_dir, name="run", output={"dir": str(disk / "run")})
        run_training(load_recipe(recipe))
        assert rundir.read_info(disk / "run")["status"] == rundir.COMPLETED
        assert (disk / "run" / "adapter_model.safetensors").is_file()


def test_a_run_stopped_by_a_user_error_in_its_loop_is_marked_interrupted(tmp_path, tiny_model_dir):
    """A loss that diverges (or a disk that fills) ends the loop with one paragraph; the run info then says
    "interrupted", not "running", and the last checkpoint is there to resume from."""
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    recipe = recipe_file(tmp_path, tiny_model_dir, name="run", train={"learning_rate": 1e30, "max_steps": 8,
                                                                      "save_steps": 1, "max_grad_norm": 0.0})
    with pytest.raises(UserError, match="the loss became"):
        run_training(load_recipe(recipe))
    assert rundir.read_info(tmp_path / "run")["status"] == rundir.INTERRUPTED
    assert rundir.checkpoints(tmp_path / "run")
