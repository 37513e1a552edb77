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
from delft.outputs import check_writable_dir, human_size
from delft.rundir import check_trained_dir, is_run_dir, read_info

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
    if out.exists() and not force:
        if out.is_dir() and not any(out.iterdir()):
            return
        kind = "a non-empty directory" if out.is_dir() else "a file"
        raise UserError(f"{out} already exists and is {kind}", "--out",
                        "Choose another --out or pass --force to replace it.")
    check_writable_dir(out.parent, "--out")
    _check_no_other_export(out)


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
    """Refuse, before the merge, an --out another running export is writing (its temporary directory)."""
    for tmp in out.parent.glob(f"{glob.escape(tmp_prefix(out))}*-*") if out.parent.is_dir() else []:
        pid = tmp.name[len(tmp_prefix(out)):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            raise UserError(f"another delft export (process {pid}) is writing {out} right now", "--out",
                            "Wait for it to finish, or export to another --out.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
