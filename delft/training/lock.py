"""One training per run directory: an advisory lock held for the whole run.

The lock is ``fcntl.flock`` on a file inside the run directory (``rundir.LOCK_FILE``), so it belongs to the
directory itself, not to one spelling of its path: a symlinked alias or a bind mount of a running run reaches
the same file (same device and inode) and is refused like the path the run was started with. ``--force``
therefore empties the directory around the lock file (``rundir.clear``) instead of deleting it. The file is
opened with O_NOFOLLOW and must be a plain file with one link: a planted symlink or hard link is refused, never
written through. The kernel drops a flock when its process dies, so a crashed or killed run never leaves it
stuck; the file it leaves behind (a clean exit deletes it) holds the dead process's pid, which the next run
reports. Only the process of rank 0 takes the lock (environment RANK, else LOCAL_RANK, unset or 0): the ranks of
one distributed run (torchrun) share the directory.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from delft import signals
from delft.errors import UserError
from delft.rundir import LOCK_FILE


@dataclass
class Lock:
    """A held lock; ``stale_pid`` is the pid recorded by an earlier holder that died without releasing it."""

    path: Optional[Path]
    stale_pid: Optional[int] = None


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_FILE


def is_rank_zero() -> bool:
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    return rank.strip() in ("", "0")


def _recorded_pid(fd: int) -> Optional[int]:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or "x")
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _not_a_lock(path: Path, what: str) -> UserError:
    return UserError(f"{path} is {what}, not the lock file delft writes there; delft does not write through it",
                     "output.dir", f"Remove {path} (nothing of the run is in it) or choose another output.dir.")


def _open(path: Path) -> int:
    """The lock file, created when missing; never through a symlink, never a file with other names."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_a_lock(path, "a symbolic link") from None
        if e.errno == errno.EISDIR:
            raise _not_a_lock(path, "a directory") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise _not_a_lock(path, "not a plain file" if not stat.S_ISREG(st.st_mode)
                          else f"a hard link ({st.st_nlink} names for one file)")
    return fd


def _open_locked(run_dir: Path, path: Path) -> int:
    """A descriptor holding the flock on ``path``; retries when a releasing holder deleted the file (or the
    directory it made) under us."""
    import fcntl

    while True:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = _open(path)
        except FileNotFoundError:  # the directory went away between mkdir and open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = _recorded_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"another delft train{f' (pid {pid})' if pid else ''} is writing to {run_dir}"
                                f"{'' if run_dir.resolve() == run_dir.absolute() else f' ({run_dir.resolve()})'}",
                                "output.dir", "Wait for it to finish, stop it (Ctrl-C saves a checkpoint), or "
                                "choose another output.dir.") from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _release(fd: int, path: Path, run_dir: Path, made: bool) -> None:
    """Delete the lock file, then the directory when this lock made it and nothing was written into it."""
    try:
        path.unlink()
    except OSError:
        pass
    os.close(fd)
    if made:
        try:
            run_dir.rmdir()
        except OSError:  # not empty: the run wrote into it
            pass


@contextmanager
def run_lock(run_dir: Path) -> Iterator[Lock]:
    """Hold the run directory's lock (rank 0 only; other ranks get a Lock without a path). The directory is made
    first (the lock lives in it) and removed again on release when it is still empty."""
    if not is_rank_zero():
        yield Lock(None)
        return
    run_dir = Path(run_dir)
    path = lock_path(run_dir)
    made, fd = not run_dir.is_dir(), None
    try:
        # a Ctrl-C or SIGTERM while the lock is being taken waits until it is held, then raises here, inside the
        # try: the lock file is never left behind by a stop that lands between its creation and the release
        with signals.held():
            fd = _acquire(run_dir, path)
        yield Lock(path, _stale(fd))
    finally:
        if fd is not None:
            _release(fd, path, run_dir, made)


def _acquire(run_dir: Path, path: Path) -> int:
    """The lock file opened and locked (the run directory made first), or one paragraph."""
    try:
        return _open_locked(run_dir, path)
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"cannot create the run directory {run_dir} here ({e.strerror}: {e.filename or run_dir})",
                        "output.dir", "Choose an output.dir in a directory you can write to.") from None


def _stale(fd: int) -> Optional[int]:
    """The pid an earlier holder left in the lock file (None: none, or this process), replaced by this one's."""
    stale = _recorded_pid(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return stale if stale != os.getpid() else None
