"""Progress a log file can show. The live bar is drawn only on a terminal; with stdout in a file the first line
would come at train.logging_steps, which on a CPU can be many minutes away. So, when the console is not a terminal,
a plain line at most every ``DELFT_PROGRESS_SECONDS`` seconds (default 30): the step, tokens per second and an
estimate of the time left."""

from __future__ import annotations

import os
import time
from typing import Optional

from rich.console import Console

from delft.errors import UserError

INTERVAL_ENV = "DELFT_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0


def progress_interval() -> float:
    """Seconds between plain progress lines: ``DELFT_PROGRESS_SECONDS`` (0: after every step), else 30."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UserError(f"{INTERVAL_ENV}={raw!r} is not a number of seconds", INTERVAL_ENV,
                        f"Give 0 or more (0: a line after every step), or unset it for {DEFAULT_INTERVAL:g}.")
    return value


def clock(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLines:
    """Plain progress lines for a console that is not a terminal (a terminal has the live bar); silent elsewhere and
    on ranks other than the first."""

    def __init__(self, console: Console, total: int, start_step: int, main: bool = True,
                 interval: Optional[float] = None):
        self.console, self.total, self.start_step = console, total, start_step
        self.on = main and not console.is_terminal
        self.interval = progress_interval() if interval is None else interval
        self.started = self.last = time.perf_counter()
        self.tokens = 0

    def step(self, step: int, tokens: int) -> None:
        """Count ``tokens`` of the step just done; print a line when the interval has passed (and not at the last
        step, which the log line reports)."""
        if not self.on:
            return
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last < self.interval or step >= self.total:
            return
        self.last = now
        elapsed = now - self.started
        done = max(step - self.start_step, 1)
        left = (self.total - step) * elapsed / done
        self.console.print(f"progress: step {step}/{self.total}  {self.tokens / max(elapsed, 1e-9):,.0f} tok/s  "
                           f"{clock(elapsed)} elapsed, about {clock(left)} left", highlight=False)
