"""Where results go: output paths checked before the long work, and files written whole or not at all.

Every file or directory delft writes for a user goes through ``staged`` (a hidden temporary sibling, renamed
into place when complete, removed on any failure) and ``follow_umask`` (the modes the user's umask asks for).

eval, inspect and compare spend minutes computing before they write ``--json``, ``--plot`` or ``--out``; a
path that cannot be written must be refused first, not after every model was evaluated.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from delft.errors import UserError


def temporary_sibling(path: Path, suffix: str = "") -> Path:
    """A hidden name beside ``path`` (same filesystem, so the final rename is atomic), unique to this process."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")


# What ``temporary_sibling`` names (``.NAME.tmp-PID`` + a suffix, or mkdtemp's ``-XXXX``) and what an export
# moves aside while it swaps (``.NAME.old-PID``): a process killed with SIGKILL leaves them behind.
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>[0-9]+)(?:[-.].*)?$", re.DOTALL)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts: it may be a delft of another user)."""
    if pid <= 0:
        return True  # never a process of ours: treat as in use, so nothing is deleted on its account
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def leftover_pid(name: str, prefix: str = "") -> Optional[int]:
    """The pid in a delft temporary's name (``.NAME.tmp-PID...``, ``.NAME.old-PID``), or None for other names;
    with ``prefix``, only temporaries of ``NAME`` == prefix."""
    m = _LEFTOVER.match(name)
    if m is None or (prefix and m.group("name") != prefix):
        return None
    return int(m.group("pid"))


def remove_dead_leftovers(directory: Path, prefix: str = "") -> list[Path]:
    """Remove the temporaries in ``directory`` (see ``leftover_pid``) whose process is dead: a kill -9 left them
    half-written. One whose process lives is another delft at work and is kept. Returns what was removed."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return []
    gone = []
    for p in sorted(directory.iterdir()):
        pid = leftover_pid(p.name, prefix)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            remove(p)
            gone.append(p)
    return gone


def said_removed(gone: list[Path]) -> str:
    """The one line that tells the user which leftovers of killed processes were removed."""
    pids = sorted({leftover_pid(p.name) for p in gone})
    names = ", ".join(str(p) for p in gone[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
    return (f"Removed {len(gone)} half-written leftover{'s' if len(gone) > 1 else ''} of a killed delft "
            f"(process{'es' if len(pids) > 1 else ''} {', '.join(map(str, pids))}, no longer running): {names}")


def remove(path: Path) -> None:
    """Remove a file, a link or a directory tree; nothing there is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(tmp: Path, path: Path, shared: Optional[Callable[[Path], bool]] = None) -> None:
    """Rename a finished ``tmp`` onto ``path``, replacing what is there. With ``shared`` (a test that ``path`` is
    a complete copy, for caches several processes fill), a complete copy another process published first is kept
    (it may be in use) and ``tmp`` dropped; an incomplete leftover is replaced."""
    path = Path(path)
    if path.exists() and not (shared and shared(path)):
        remove(path)
    try:
        os.replace(tmp, path)
    except OSError:
        if not (shared and shared(path)):
            raise
        remove(tmp)


@contextmanager
def staged(path: Path, suffix: str = "", shared: Optional[Callable[[Path], bool]] = None) -> Iterator[Path]:
    """Write ``path`` (a file or a directory) under the yielded temporary sibling; when the block ends it is
    published onto ``path`` whole, and on any failure (an error, a full disk, Ctrl-C) it is removed."""
    tmp = temporary_sibling(path, suffix)
    remove(tmp)
    try:
        yield tmp
        publish(tmp, path, shared)
    except BaseException as e:
        remove(tmp)
        if is_disk_full(e):
            raise disk_full(path) from None
        raise


NO_SPACE = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def is_disk_full(e: BaseException) -> bool:
    """A full disk or quota: an OSError, or the plain exception Rust writers raise (tokenizers' tokenizer.json,
    safetensors), which only say "(os error 28)" in their text."""
    if isinstance(e, UserError):
        return False  # already said
    if isinstance(e, OSError):
        return e.errno in NO_SPACE
    text = str(e)
    return isinstance(e, Exception) and any(f"(os error {n})" in text or why in text for n, why in NO_SPACE.items())


def disk_full(path: Path, where: Optional[str] = None, then: str = "run the same command again") -> UserError:
    """The one paragraph for a write that found the disk (or the quota) full."""
    return UserError(f"the disk is full (or your quota used up): {path} could not be written, and nothing was left "
                     "half-written", where, f"Free some space, then {then}.")


@contextmanager
def no_space_is_a_user_error(path: Path, where: Optional[str] = None, then: str = "run the same command again",
                             partial: Optional[Path] = None) -> Iterator[None]:
    """A full disk while the block writes ``path``: ``partial`` (a temporary being filled) removed, then
    ``disk_full``'s paragraph instead of a traceback. Other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        if partial is not None:
            remove(partial)
        raise disk_full(path, where, then) from None


def append_line(path: Path, line: str, where: Optional[str] = None, then: str = "run the same command again") -> None:
    """``line`` and a newline appended to a log (metrics.jsonl) whole or not at all: when the disk fills midway,
    the bytes that went in are cut off again, so no half line is left for a reader."""
    data = memoryview((line + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            if not is_disk_full(e):
                raise
            os.ftruncate(fd, start)
            raise disk_full(path, where, then) from None
    finally:
        os.close(fd)


def tables_console():
    """A plain-text recorder for tables.txt: what compare and study show on the screen, without colour, 150
    columns wide (``.export_text()`` gives the file's text)."""
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), record=True, width=150, force_terminal=False, color_system=None)


def plain_table(header, rows, title: Optional[str] = None):
    """A rich table of ``header`` and ``rows`` (strings), for the terminal and tables.txt alike."""
    from rich.table import Table

    table = Table(title=title)
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file whole or not at all."""
    with staged(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def holds_cwd_or_home(path: Path) -> bool:
    """Whether ``path`` (resolved) is the current directory, one above it, or the home directory: what no
    ``--force`` of delft's (train's run directory, export's --out) may ever replace."""
    where, here = Path(path).expanduser().resolve(), Path.cwd().resolve()
    return where == here or where in here.parents or where == Path.home().resolve()


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (where a missing directory would be created)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(directory: Path, flag: str) -> None:
    """``directory`` exists and takes a new file, or can be created: probed by creating (and removing) one."""
    where = nearest_existing(directory)
    if not where.is_dir():
        raise UserError(f"{where} is a file, so {directory} cannot be a directory", flag,
                        "Choose a path whose parent is a directory.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".delft-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write in {where} ({e.strerror or e})", flag,
                        "Choose a directory you can write to, or fix its permissions.") from None


def check_output_file(path: Path, flag: str) -> None:
    """A file result (``--json``, ``--plot``): not a directory or a device, in a directory delft can write."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory", flag, f"Give a file name, e.g. {path / 'result'}{path.suffix}.")
    if path.exists() and not path.is_file():
        raise UserError(f"{path} exists and is not a regular file", flag, "Give the path of a new or plain file.")
    check_writable_dir(path.parent, flag)


def check_output_dir(path: Path, flag: str) -> None:
    """A directory of results (compare's ``--out``): not an existing file, writable or creatable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} exists and is a file, not a directory", flag, "Choose a directory for the results.")
    check_writable_dir(path, flag)


def write_result(path: Path, data: str | bytes, flag: str) -> None:
    """Write one result file atomically (parents created); disk full or no permission is one paragraph."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError as e:
        raise UserError(f"could not write {path} ({e.strerror or e})", flag,
                        "Free some space or choose another path, then run the command again (the results "
                        "printed above were not saved).") from None


def check_output_files(paths: dict[str, Path | None]) -> None:
    """Every given result file of one command (flag -> path), and no two of them the same file."""
    given = {flag: Path(p) for flag, p in paths.items() if p is not None}
    for flag, path in given.items():
        check_output_file(path, flag)
    seen: dict[str, str] = {}
    for flag, path in given.items():
        key = os.path.abspath(path)
        if key in seen:
            raise UserError(f"{seen[key]} and {flag} name the same file {path}", flag, "Give each its own file.")
        seen[key] = flag


@contextmanager
def result_set(out: Path, old: Iterable[str], flag: str) -> Iterator[Path]:
    """Write one command's result files into the yielded fresh directory beside ``out``; when the block ends they
    replace that command's earlier files in ``out`` as a set: the files named in ``old`` (plain names; files only)
    are removed, then the new ones moved in, so two runs' results never mix and nothing else in ``out`` is touched.
    A new ``out`` is the finished directory renamed into place. On any failure while writing, ``out`` is as it was."""
    out = Path(out)
    tmp = temporary_sibling(out, ".new")

    def failed(e: OSError) -> UserError:
        remove(tmp)
        return UserError(f"could not write the results into {out} ({e.strerror or e})", flag,
                         "Free some space or fix the permissions, then run the command again.")

    remove(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise failed(e) from None
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    try:
        if not out.exists():
            os.replace(tmp, out)
            return
        for name in old:
            if (out / Path(name).name).is_file():
                (out / Path(name).name).unlink()
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
        tmp.rmdir()
    except OSError as e:
        raise failed(e) from None


def write_figure(fig, path: Path, flag: str, **savefig) -> None:
    """A matplotlib figure as a PNG, written like every other result (atomically, errors as one paragraph)."""
    import io

    png = io.BytesIO()
    fig.savefig(png, format="png", **savefig)
    write_result(path, png.getvalue(), flag)


def follow_umask(directory: Path) -> None:
    """Give a finished directory (made by tempfile.mkdtemp, hence 0700) and its files the modes the user's umask
    gives new files (e.g. 0755 / 0644), as if they had been created in place."""
    mask = os.umask(0)
    os.umask(mask)
    directory = Path(directory)
    os.chmod(directory, 0o777 & ~mask)
    for p in directory.rglob("*"):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def pct(x: Optional[float], unit: str = " %", digits: int = 1) -> str:
    """A rate in [0, 1] as a percentage for tables and summaries; '-' where undefined."""
    return "-" if x is None else f"{100 * x:.{digits}f}{unit}"


def num(x: Optional[float], spec: Optional[str] = None) -> str:
    """A metric value: four significant figures (scientific past a million) unless ``spec``; '-' where undefined."""
    if x is None:
        return "-"
    if spec:
        return format(x, spec)
    return f"{x:.4g}" if abs(x) < 1e6 else f"{x:.3e}"


def human_size(n: float) -> str:
    """Bytes in decimal units (B, KB, MB, GB, TB), as disk tools print them."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
