"""Sharded checkpoints (train.distributed: fsdp) on ``torch.distributed.checkpoint`` (DCP), read as data only.

A sharded checkpoint is one directory: DCP's ``.metadata`` (an index of every saved item: names, shapes, which file
and byte range holds it), one ``__R_0.distcp`` per rank that wrote it, delft's ``sharded.json`` (the world size) and
``trainer_state.pt`` (step, scheduler, RNG; written last: a checkpoint is complete once it is there). Every rank
writes its shards into one staged directory and rank 0 renames it into place, so a checkpoint is whole or not there;
another number of ranks re-shards it on load.

Why this module reads DCP's files itself: torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with
plain ``pickle.load``, and its ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` for every
non-tensor item (the optimizer's param groups). Either runs whatever code a ``__reduce__`` planted in the file names,
on every rank, and PyTorch's security policy leaves DCP to trusted checkpoints
(https://github.com/pytorch/pytorch/security/policy). Run folders are shared and copied, so before DCP touches a
checkpoint, delft:

- unpickles ``.metadata`` with an unpickler that admits only DCP's own metadata classes (and torch.Size, dtypes,
  layouts, a path), so a planted callable is refused before anything runs;
- loads every non-tensor item ``weights_only`` (plain data), here first and in the planner DCP uses;
- checks that every byte range the index names lies inside a file of the checkpoint itself.

A planted file is refused in one paragraph and nothing is deleted; a damaged one (a truncated ``.distcp``, a
missing ``.metadata``) is ``Damaged``, and the caller falls back to an older checkpoint.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # how DefaultLoadPlanner.load_bytes places an item
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from delft import rundir
from delft.errors import UserError
from delft.outputs import disk_full, follow_umask, is_disk_full, publish, remove, temporary_sibling
from delft.training import distributed as dist
from delft.training.checkpoints import AGAIN, check_free_space, read_state, weights_only_refusal

SHARDED_MARK = "sharded.json"  # the world size that wrote the checkpoint
METADATA = ".metadata"  # DCP's index of the checkpoint
SHARD_SUFFIX = ".distcp"  # DCP's data files, one per writing rank

# What DCP's .metadata may name: its own metadata classes and the few torch values they hold. Anything else (a
# callable such as os.system, subprocess.Popen, builtins.eval) is refused before it is looked up.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided), from a fixed table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class Damaged(Exception):
    """A checkpoint whose files are missing, cut short or unreadable: an older one may still load."""


class _Planted(Exception):
    """A checkpoint file that names Python objects delft never writes there."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):  # torch.float32 and its kin
            return getattr(torch, name)
        raise _Planted(f"{module}.{name}")


def refuse_planted(path: Path, ckpt: Path, what: str) -> UserError:
    """The paragraph for a checkpoint file that holds more than data: nothing was loaded, nothing deleted."""
    return UserError(f"{path} holds Python objects that delft never writes into a sharded checkpoint ({what[:160]}); "
                     "loading it could run code planted in it, so it was not loaded on any rank and nothing was "
                     "deleted", "output.dir",
                     f"Resume only runs you made (put the file you wrote back). To resume from an older checkpoint, "
                     f"remove {ckpt} yourself; to start over, pass --force.")


def is_sharded_checkpoint(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds DCP's files (or delft's mark of them): recognised by its files, so one whose
    sharded.json or .metadata is missing is still known for what it is."""
    ckpt = Path(ckpt)
    return ((ckpt / SHARDED_MARK).is_file() or (ckpt / METADATA).is_file()
            or any(ckpt.glob(f"*{SHARD_SUFFIX}")))


def read_metadata(ckpt: Path) -> Metadata:
    """DCP's index of ``ckpt``, unpickled with only DCP's own classes admitted (``refuse_planted`` otherwise)."""
    path = Path(ckpt) / METADATA
    if not path.is_file():
        raise Damaged(f"its {METADATA} is missing")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Planted as e:
        raise refuse_planted(path, ckpt, f"the global {e}") from None
    except Exception as e:  # cut short, or not a pickle: an older checkpoint may do
        raise Damaged(f"its {METADATA} cannot be read ({type(e).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise Damaged(f"its {METADATA} is not DCP's index")
    return metadata


def _check_ranges(ckpt: Path, metadata: Metadata) -> None:
    """Every item's byte range inside a data file of ``ckpt`` itself (a truncated or missing shard is Damaged)."""
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise refuse_planted(Path(ckpt) / METADATA, ckpt, f"an item stored at {str(name)[:80]!r}, outside the "
                                                              "checkpoint")
        if getattr(info, "transform_descriptors", None):  # delft writes plain shards (no compression)
            raise Damaged(f"{name} is stored with transforms delft does not write ({info.transform_descriptors})")
        if name not in sizes:
            path = Path(ckpt) / name
            sizes[name] = path.stat().st_size if path.is_file() else -1
        if sizes[name] < 0:
            raise Damaged(f"its shard {name} is missing")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
            raise Damaged(f"its shard {name} is cut short ({sizes[name]:,} bytes, an item ends at "
                          f"{info.offset + info.length:,})")


def _load_bytes_item(value: io.BytesIO, path: Path, ckpt: Path):
    """One non-tensor item (an optimizer setting) as plain data; anything else is refused, never unpickled."""
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        reason = weights_only_refusal(e)
        if reason is None:
            raise Damaged(f"an item of {path.name} cannot be read") from None
        raise refuse_planted(path, ckpt, reason or "not plain data") from None
    except Exception as e:
        raise Damaged(f"an item of {path.name} cannot be read ({type(e).__name__})") from None


def _check_bytes_items(ckpt: Path, metadata: Metadata) -> None:
    """Every non-tensor item read as data before DCP reads it (they are small: the optimizer's settings)."""
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = Path(ckpt) / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            _load_bytes_item(io.BytesIO(f.read(info.length)), path, ckpt)


def check(ckpt: Path) -> tuple[Metadata, dict]:
    """(DCP's index, delft's trainer state) of ``ckpt``, every file checked as data before anything is loaded:
    ``refuse_planted``'s UserError for a file that holds more than data, ``Damaged`` for one that is incomplete."""
    if not (Path(ckpt) / SHARDED_MARK).is_file():
        raise Damaged(f"its {SHARDED_MARK} is missing")
    metadata = read_metadata(ckpt)
    _check_ranges(ckpt, metadata)
    _check_bytes_items(ckpt, metadata)
    try:
        state = read_state(ckpt)  # weights-only; a planted one is a UserError
    except UserError:
        raise
    except Exception as e:
        raise Damaged(f"its {rundir.STATE_FILE} cannot be read ({type(e).__name__})") from None
    return metadata, state


class _CheckedReader(FileSystemReader):
    """DCP's file reader handed the index ``check`` already read, so ``.metadata`` is never unpickled by torch."""

    def __init__(self, ckpt: Path, metadata: Metadata):
        super().__init__(str(ckpt))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner with non-tensor items loaded ``weights_only`` (torch's loads them with full pickle)."""

    def __init__(self, ckpt: Path):
        super().__init__()
        self._ckpt = Path(ckpt)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = _load_bytes_item(value, self._ckpt / METADATA, self._ckpt)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], data)
        else:
            self.state_dict[read_item.dest_index.fqn] = data


def _states(root, optimizer) -> dict:
    return {"model": get_model_state_dict(root), "optimizer": get_optimizer_state_dict(root, optimizer)}


def load(ckpt: Path, metadata: Metadata, root, optimizer) -> None:
    """The shards of a ``check``-ed ``ckpt`` into this rank's part of the model and optimizer (every rank calls
    it), re-sharded when another number of ranks wrote it. A failure on any rank raises ``Damaged`` on all."""
    states = _states(root, optimizer)
    try:
        dcp.load(states, storage_reader=_CheckedReader(ckpt, metadata), planner=_DataOnlyPlanner(ckpt))
    except CheckpointException as e:  # gathered from every rank, so all ranks raise it together
        exc = next((pair[0] for pair in e.failures.values()), None)
        if isinstance(exc, UserError):
            raise exc from None
        first = str(exc).strip().splitlines()[0][:120] if exc is not None and str(exc).strip() else ""
        raise Damaged(f"its shards cannot be loaded ({type(exc).__name__}: {first})") from None
    set_model_state_dict(root, states["model"])
    set_optimizer_state_dict(root, optimizer, states["optimizer"])


def _local_bytes(root, optimizer) -> int:
    """This rank's shards of the weights and of the optimizer's states: its part of a checkpoint."""
    def size(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    states = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(size(p) for p in root.parameters()) + sum(size(v) for v in states)


def _staging_dir(final: Path) -> Path:
    """Rank 0's temporary name for ``final``, the same on every rank (its pid marks a dead run's leftover)."""
    name = [str(temporary_sibling(final))] if dist.is_main() else [None]
    tdist.broadcast_object_list(name, src=0)
    return Path(name[0])


def _write_failure(e: BaseException) -> BaseException:
    """The error under a failed write (DCP gathers every rank's into one CheckpointException)."""
    if isinstance(e, CheckpointException):
        return next((pair[0] for pair in e.failures.values() if pair[0] is not None), e)
    return e


def _is_full(e: BaseException, where: Path, need: int) -> bool:
    """A full disk, also where torch's zip writer hides the errno ("unexpected pos", "file write failed")."""
    if is_disk_full(e):
        return True
    hidden = any(s in str(e) for s in ("unexpected pos", "file write failed", "PytorchStreamWriter failed"))
    return hidden and shutil.disk_usage(where).free < need


def _write(tmp: Path, root, optimizer, trainer_state: dict) -> None:
    """Every rank's shards, then (rank 0) the mark and the trainer state: the state file last."""
    dcp.save(_states(root, optimizer), checkpoint_id=str(tmp))
    if dist.is_main():
        (tmp / SHARDED_MARK).write_text(json.dumps({"world_size": dist.world_size()}))
        torch.save(trainer_state, tmp / rundir.STATE_FILE)
        follow_umask(tmp)


def save(run_dir: Path, root, optimizer, trainer_state: dict, keep: int) -> Optional[Path]:
    """Every rank's shards and rank 0's trainer state into one staged directory, renamed into place by rank 0 once
    all have written: the checkpoint (on rank 0; None elsewhere). A disk that fills midway is the one-process
    paragraph on every rank, and the staged directory is removed."""
    final = rundir.checkpoint_path(run_dir, trainer_state["step"])
    # every rank checks the whole checkpoint's size against the shared disk, so all refuse together, none hangs
    need = int(dist.all_reduce_floats([float(_local_bytes(root, optimizer))])[0]) + 2**20
    final.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(final.parent, need, "checkpoint")
    tmp = _staging_dir(final)
    if dist.is_main():
        remove(tmp)
        tmp.mkdir()
    dist.barrier("the checkpoint's directory")
    failure: Optional[BaseException] = None
    try:
        _write(tmp, root, optimizer, trainer_state)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        failure = _write_failure(e)
    if dist.all_reduce_floats([float(failure is not None)])[0]:  # every rank learns that a write failed
        if dist.is_main():
            remove(tmp)
        if failure is None:
            raise UserError(f"another rank could not write its part of the checkpoint {final}", "output.dir",
                            f"See rank 0's message; {AGAIN}.")
        if _is_full(failure, final.parent, need):
            raise disk_full(final, "output.dir", AGAIN)
        raise failure
    if not dist.is_main():
        return None
    publish(tmp, final)
    for old in rundir.checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
