"""Ctrl-C and SIGTERM anywhere in a command: stop it (exit 130 / 143) with nothing half-written (training's own
handling, which saves a checkpoint first, is delft.training.signals).

A signal's handler runs wherever Python happens to be, also inside a finalizer (``__del__``, a weakref
callback) that a garbage collection pass runs; an exception raised there is printed as "Exception ignored" and
lost, and the command runs on. So every handler here also records the signal for the whole command
(``received``), ``held`` keeps signals out of a collection pass delft starts itself, and ``check`` stops the
command at the points between units of work (an arm of a study, a model of an eval) where a signal that was
lost anyway is noticed.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Command:
    """The stop signals of one command run under ``stop_on_signals`` (the first one sets the exit code)."""

    def __init__(self):
        self.first: Optional[int] = None


_command: Optional[_Command] = None  # set while a command runs under stop_on_signals


def note(signum: int) -> None:
    """Record ``signum`` for the running command (the first one counts)."""
    if _command is not None and _command.first is None:
        _command.first = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def received() -> Optional[int]:
    """The first SIGINT or SIGTERM the running command got (None: none, or no command runs)."""
    return _command.first if _command is not None else None


def describe(signum: Optional[int]) -> str:
    """How a stop is told: "Interrupted" (Ctrl-C) or "Stopped (SIGTERM)"."""
    return "Stopped (SIGTERM)" if signum == signal.SIGTERM else "Interrupted"


def exit_code(signum: Optional[int]) -> int:
    """The shell's code for a process stopped by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + (signum or signal.SIGINT)


def _raise(signum, frame):
    note(signum)
    raise KeyboardInterrupt


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """A whole command: SIGINT and SIGTERM both raise KeyboardInterrupt (SIGTERM's default would end the
    process on the spot, mid-write, without a word) and are recorded; the previous handlers come back after."""
    global _command
    outer, _command = _command, _Command()
    old = {s: signal.signal(s, _raise) for s in SIGNALS} if _main_thread() else {}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _command = outer


def check() -> None:
    """Stop the command (KeyboardInterrupt) if it got a signal whose exception was lost (see the module's text).
    Call it only where no exception is on its way out, between units of work."""
    if received() is not None:
        raise KeyboardInterrupt


@contextmanager
def held() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM only wait; at the end the first one goes to the handler that was there
    (a garbage collection pass runs finalizers, where a raised KeyboardInterrupt would be lost)."""
    if not _main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if got:
        handler = old[got[0]]
        if callable(handler):
            handler(got[0], None)
        elif handler == signal.SIG_DFL:  # outside a command (a library caller): the default action, as without us
            os.kill(os.getpid(), got[0])


def forget_handled_interrupt() -> None:
    """Clear CPython's memory of an "unhandled" KeyboardInterrupt once delft has handled the stop.

    A KeyboardInterrupt raised while the interpreter runs code through ``PyRun_*`` (a C extension running a
    string of Python while a module imports) sets a process-wide flag that nothing clears when the exception is
    caught later; at exit ``Py_RunMain`` sees it and ends the process by SIGINT (status -2) instead of the 143 or
    130 delft chose. ``run_eval_code_obj`` resets that flag before it runs anything, so running an empty string
    through ``PyRun_SimpleString`` clears it on every CPython (the flag itself is private and moved in 3.12)."""
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")
    except (ImportError, AttributeError, OSError):  # no ctypes or no CPython API: nothing to clear
        pass

