"""One training per run directory: an advisory lock held for the whole run.

The lock is ``fcntl.flock`` on a file beside the run directory (``.<name>.lock``), not inside it, so that
``--force`` can delete the directory while the lock holds. The kernel drops a flock when its process dies,
so a crashed or killed run never leaves it stuck; the file it leaves behind (a clean exit deletes it) holds
the dead process's pid, which the next run reports. Only the process of rank 0 takes the lock (environment
RANK, else LOCAL_RANK, unset or 0): the ranks of one distributed run (torchrun) share the directory.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from delft.errors import UserError


@dataclass
class Lock:
    """A held lock; ``stale_pid`` is the pid recorded by an earlier holder that died without releasing it."""

    path: Optional[Path]
    stale_pid: Optional[int] = None


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


def is_rank_zero() -> bool:
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    return rank.strip() in ("", "0")


def _recorded_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def _open_locked(path: Path) -> int:
    """A descriptor holding the flock on ``path``; retries when a releasing holder deleted the file under us."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                pid = _recorded_pid(path)
                raise UserError(f"another delft train{f' (pid {pid})' if pid else ''} is writing to "
                                f"{path.parent / path.name[1:-len('.lock')]}", "output.dir",
                                "Wait for it to finish, stop it (Ctrl-C saves a checkpoint), or choose another "
                                "output.dir.") from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextmanager
def run_lock(run_dir: Path) -> Iterator[Lock]:
    """Hold the run directory's lock (rank 0 only; other ranks get a Lock without a path)."""
    if not is_rank_zero():
        yield Lock(None)
        return
    path = lock_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        fd = _open_locked(path)
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"cannot create the run directory {run_dir} here ({e.strerror}: {e.filename or path.parent})",
                        "output.dir", "Choose an output.dir in a directory you can write to.") from None
    stale = _recorded_pid(path) if existed else None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    try:
        yield Lock(path, stale if stale != os.getpid() else None)
    finally:
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)
