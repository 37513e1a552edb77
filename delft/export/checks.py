"""Checks before an export starts: the run directory, --out (never inside the run or over a file the user made),
another export writing the same --out, and free disk space for the merged model.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path
from typing import Optional

from delft.errors import UserError
from delft.outputs import (
    check_writable_dir,
    holds_cwd_or_home,
    human_size,
    pid_alive,
    remove_dead_leftovers,
)
from delft.rundir import EXPORT_INFO, RUN_INFO, check_trained_dir, is_run_dir, read_info

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


DISK_MARGIN = 1.1


def normalize_dtype(name: str) -> str:
    key = str(name).lower().replace("torch.", "")
    if key not in DTYPES:
        raise UserError(f"unknown dtype {name!r}", "--dtype", "Use bfloat16 (default), float16 or float32.")
    return DTYPES[key]


def check_run_dir(run_dir: Path) -> dict:
    """The run's delft_run.json (may be empty for adapters not written by delft); refuses dirs with no adapter,
    except a fully fine-tuned `delft train` run (its model is the export's input)."""
    check_trained_dir(run_dir, "delft export", merged=is_run_dir(run_dir))
    return read_info(run_dir)


def _within(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


def check_out(out: Path, force: bool, protected: dict[str, Path]) -> None:
    """Refuse a non-empty --out without --force, and any --out whose replacement would delete an input."""
    for what, path in protected.items():
        if path is not None and path.exists() and _within(path, out):
            raise UserError(f"--out {out} contains the {what} ({path}); replacing it would delete it", "--out",
                            "Choose a new directory, e.g. --out merged/NAME.")
    run = protected.get("run directory")
    inside = next((d for d in (out.resolve(), *out.resolve().parents) if (d / RUN_INFO).is_file()), None)
    if run is not None and _within(out, run):
        inside = run
    if inside is not None:  # a run's files are the trainer's (a resume, eval and compare read them): never mixed
        raise UserError(f"--out {out} is inside the run directory {inside}: the export would write among the run's "
                        "own files", "--out", "Choose a directory of its own, e.g. --out merged/NAME.")
    if out.exists() and not force:
        if out.is_dir() and not any(out.iterdir()):
            return
        kind = "a non-empty directory" if out.is_dir() else "a file"
        raise UserError(f"{out} already exists and is {kind}", "--out",
                        "Choose another --out or pass --force to replace it.")
    if force and (out.exists() or out.is_symlink()):
        check_replaceable(out)
    check_writable_dir(out.parent, "--out")
    _check_no_other_export(out)


def check_replaceable(out: Path) -> None:
    """``export --force`` replaces only an earlier export (a directory holding delft's EXPORT_INFO) or an empty
    directory: never the current directory, one above it, home, a file or a link (train --force's rule)."""
    if holds_cwd_or_home(out):
        raise UserError(f"--force would replace {out} ({out.expanduser().resolve()}), which holds the current "
                        "directory or your home",
                        "--out", "Name a new directory for the export, e.g. --out merged/NAME.")
    fix = "Choose a new --out or an earlier export; delft never deletes other data."
    if out.is_symlink():
        raise UserError(f"--force replaces only an earlier delft export, and {out} is a symbolic link", "--out", fix)
    if not out.is_dir():
        raise UserError(f"--force replaces only an earlier delft export, and {out} is a file", "--out", fix)
    marker = out / EXPORT_INFO
    if any(out.iterdir()) and (marker.is_symlink() or not marker.is_file()):
        raise UserError(f"--force replaces only an earlier delft export, and {out} is not one (it has no "
                        f"{EXPORT_INFO})", "--out", fix)


def remove_export_leftovers(out: Path) -> list[Path]:
    """What a killed export of ``out`` left: its temporary directory and the earlier export it had moved aside
    (beside ``out``), and half-written GGUF files (inside an earlier export); only those of dead processes."""
    out = Path(out)
    if not out.name or out.name in (".", ".."):
        return []
    gone = remove_dead_leftovers(out.parent, out.name)
    if not out.is_symlink() and (out / EXPORT_INFO).is_file():
        gone += remove_dead_leftovers(out)
    return gone


def local_param_count(path: str) -> Optional[int]:
    """Parameters in a local model directory's safetensors files (headers only); None when not knowable."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    total = 0
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    n = 1
                    for d in sf.get_slice(k).get_shape():
                        n *= d
                    total += n
    except Exception:
        return None
    return total


def check_disk(out: Path, n_params: int, dtype: str, gguf_bytes_per_param: float = 0.0) -> int:
    """Refuse when the filesystem holding --out has less than n_params x (the dtype's bytes + the GGUF files'
    bytes per parameter) x 1.1 free; returns the estimate."""
    need = int(n_params * (DTYPE_BYTES[dtype] + gguf_bytes_per_param) * DISK_MARGIN)
    where = out.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        gguf = f" + {gguf_bytes_per_param:.2f} for the GGUF files" if gguf_bytes_per_param else ""
        raise UserError(f"not enough free disk space in {where}: the merged model needs about {human_size(need)} "
                        f"({n_params:,} parameters x {DTYPE_BYTES[dtype]} bytes in {dtype}{gguf} + 10 %), "
                        f"{human_size(free)} is free", "--out",
                        "Free some space, choose --out on another disk"
                        + (", or export --dtype bfloat16 (half the size)." if dtype == "float32" else "."))
    return need




def tmp_prefix(out: Path) -> str:
    """Temporary export directories beside ``out``: this prefix, then the pid of the export writing it."""
    return f".{out.name}.tmp-"


def _check_no_other_export(out: Path) -> None:
    """Refuse, before the merge, an --out another running export is writing (its temporary directory), under
    this spelling of --out or the path it resolves to (a symlinked alias)."""
    for spelling in dict.fromkeys((out, out.resolve())):
        parent = spelling.parent
        for tmp in parent.glob(f"{glob.escape(tmp_prefix(spelling))}*-*") if parent.is_dir() else []:
            pid = tmp.name[len(tmp_prefix(spelling)):].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
                raise UserError(f"another delft export (process {pid}) is writing {out} right now", "--out",
                                "Wait for it to finish, or export to another --out.")
