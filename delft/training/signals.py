"""Ctrl-C and SIGTERM during training: finish or abandon the step in flight, save a checkpoint, exit resumable.
The command-wide part (the record of the signal, ``held``, ``check``) is delft.signals.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Optional

from delft.signals import SIGNALS, describe, exit_code, note, received


class StopSignals:
    """While training, SIGINT (Ctrl-C) and SIGTERM both raise KeyboardInterrupt, so either one saves a
    checkpoint and exits; inside ``atomic()`` (committing an optimizer step) the signal waits for its end, so
    a checkpoint never holds half a step. With ``immediate`` False the signal is only ever recorded, also at the
    end of ``atomic()``: the loop that checks ``received`` decides where to stop (a sharded run's ranks agree on
    it at the step's end, after its log line). The previous handlers come back on exit."""

    SIGNALS = SIGNALS

    def __init__(self, immediate: bool = True):
        self.received: Optional[int] = None  # with immediate False, the signal is only recorded here: the caller
        # checks it between steps (a loop it does not own, such as TRL's, cannot take an exception mid-step)
        self._immediate = immediate
        self._deferring, self._pending, self._old = False, False, {}

    def _handle(self, signum, frame):
        note(signum)
        if self.received is not None:  # a repeat (torchrun forwards the launcher's signal too) must not cut the save short
            return
        self.received = signum
        if not self._immediate:
            return
        if self._deferring:
            self._pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self):
        self.received, self._pending, self._deferring = None, False, False
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    @contextmanager
    def atomic(self):
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    @property
    def how(self) -> str:
        return describe(self.received or received())

    @property
    def exit_code(self) -> int:
        return exit_code(self.received or received())
