"""A log file shows progress (issue 52, item 3): with stdout in a file, plain progress lines come before the first
logging step; their interval is DELFT_PROGRESS_SECONDS (0 here: after every step, so the test waits on no clock)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import recipe_file
from rich.console import Console

from delft.errors import UserError
from delft.training.progress import INTERVAL_ENV, ProgressLines, clock, progress_interval


@pytest.mark.slow  # a delft train subprocess
def test_delft_train_into_a_file_prints_progress_lines_before_the_first_logging_step(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 4, "logging_steps": 4, "eval_steps": 4,
                                                          "save_steps": 4})
    log = tmp_path / "train.log"
    env = {**os.environ, INTERVAL_ENV: "0"}
    with open(log, "w") as out:
        r = subprocess.run([sys.executable, "-m", "delft", "train", str(recipe)], stdout=out, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    progress = [i for i, line in enumerate(lines) if line.startswith("progress: step ")]
    first_log = next(i for i, line in enumerate(lines) if re.match(r"step\s+4/4\s+loss", line))
    assert [lines[i].split()[2] for i in progress] == ["1/4", "2/4", "3/4"], lines
    assert progress[-1] < first_log
    assert all(re.search(r"\d+ tok/s  \d+s elapsed, about \d+s left$", lines[i]) for i in progress), lines


def test_a_terminal_gets_no_plain_lines_and_an_interval_is_waited_for():
    term = Console(force_terminal=True, record=True)
    ProgressLines(term, 10, 0, interval=0).step(1, 100)
    assert term.export_text() == ""
    plain = Console(force_terminal=False, record=True, width=200)
    lines = ProgressLines(plain, 10, 0, interval=3600)
    lines.step(1, 100)
    assert plain.export_text() == ""  # not yet an hour
    lines.last -= 3600
    lines.step(2, 100)
    assert plain.export_text().startswith("progress: step 2/10")


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_interval_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(INTERVAL_ENV, raw)
    with pytest.raises(UserError, match=INTERVAL_ENV):
        progress_interval()


def test_clock():
    assert (clock(5), clock(75), clock(3725)) == ("5s", "1m15s", "1h02m")
