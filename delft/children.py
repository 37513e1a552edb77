"""Child processes tied to delft's life: the GGUF phase's converter and quantiser, and llama.cpp (export's check,
eval's llama.cpp backend); training's data-parallel workers use :func:`on_parent_death` too.

Each runs under a small guardian (this file, run as a script: standard library only). The kernel sends the
guardian SIGTERM when delft dies, even by SIGKILL; the guardian then kills its child and removes the files the
child was writing (a half-written GGUF is hundreds of MB, under a hidden name nobody would rename). A child that
dies by a signal makes the guardian die by the same signal, so delft still reads SIGILL or SIGSEGV from it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1


def on_parent_death(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where that cannot be asked (not
    Linux, no prctl)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return False
    return True


def describe_exit(returncode: int) -> str:
    """A child's exit status in words: 'killed by SIGILL (an instruction this CPU traps: ...)', 'exit status 3'."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else str(-returncode)
        why = {"SIGILL": " (an instruction this CPU traps: llama.cpp was built for another CPU)",
               "SIGSEGV": " (a crash inside llama.cpp)", "SIGKILL": " (killed, often for memory)"}.get(name, "")
        return f"killed by {name}{why}"
    return f"exit status {returncode}"


def run(cmd: list[str], owned=(), **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kwargs) under a guardian that removes ``owned`` (the paths the child writes) and
    kills the child when delft dies."""
    guardian = [sys.executable, str(Path(__file__).resolve()), json.dumps([str(p) for p in owned]), *cmd]
    try:
        return subprocess.run(guardian, preexec_fn=_guardian_start, **kwargs)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: subprocess.run has killed the guardian, so the cleanup is ours
        _remove([str(p) for p in owned])
        raise


def _guardian_start() -> None:
    """In the guardian's process before it starts Python: SIGTERM (delft died) held back until the guardian's
    handler is set, so a delft killed while the guardian starts up still gets its files removed."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    on_parent_death(signal.SIGTERM)


def _remove(paths: list[str]) -> None:
    for p in map(Path, paths):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class _DelftDied(Exception):
    pass


def _guard(owned: list[str], cmd: list[str]) -> int:
    """The guardian: run ``cmd``; on SIGTERM (delft died) kill it and remove ``owned``; pass its status on."""
    def delft_died(signum, frame):
        raise _DelftDied  # out of child.wait(), which holds a lock a second wait() here would wait on forever

    signal.signal(signal.SIGTERM, delft_died)
    child = None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])  # held back by _guardian_start until now
        if os.getppid() == 1:  # delft died before the request took effect
            raise _DelftDied
        # a child forked just before _DelftDied is never assigned: its own PDEATHSIG kills it as the guardian exits
        child = subprocess.Popen(cmd, preexec_fn=lambda: on_parent_death(signal.SIGKILL))
        code = child.wait()
    except _DelftDied:
        if child is not None:
            child.kill()
            child.wait()
        _remove(owned)
        os._exit(128 + signal.SIGTERM)
    if code < 0:  # died by a signal: die by the same one, so delft sees it as if it had run the child itself
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(_guard(json.loads(sys.argv[1]), sys.argv[2:]))
