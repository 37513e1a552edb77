"""``delft train RECIPE``: the recipe (read by the CLI with its ``--set`` overrides), ``--nproc`` relaunched under torchrun, and the
recipe's stage trained (delft.training.stages) with the command that resumes it spelled for the user."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft.recipe.schema import Recipe
from delft.training.distributed import launched, world_size
from delft.training.launch import LAUNCH_COMMAND_ENV, Nodes, check_nproc, relaunch, strip_nproc
from delft.training.stages import run_training


def train_command(cfg: Recipe, resume: Optional[bool], force: bool, nproc: Optional[int], oversubscribe: bool,
                  console: Console, nodes: Nodes = Nodes()) -> Path:
    """Train ``cfg`` (the recipe as the CLI read it, with its ``--set`` overrides: checked before this module loads
    torch); with ``nproc`` given (more than one, or for a sharded run any number) or several nodes, this process
    hands over to torchrun starting ``nproc`` workers on this machine (default 1)."""
    sharded = cfg.train.distributed == "fsdp"
    again = shlex.join(["delft", *(a for a in sys.argv[1:] if a not in ("--force", "--no-resume"))])
    if (nproc or 1) > 1 or nodes.count > 1 or (sharded and nproc is not None):
        check_nproc(nproc or 1, cfg.model.device, oversubscribe)
        relaunch(nproc or 1, strip_nproc([a for a in sys.argv[1:] if a != "--oversubscribe"]), nodes, again)
    if launched():  # a launcher's worker: the user resumes with the launch command, not with this argv
        again = os.environ.get(LAUNCH_COMMAND_ENV) or (f"the same launch command ({again}, started by torchrun or "
                                                       f"accelerate with {world_size()} processes)")
    return run_training(cfg, resume=resume, force=force, console=console, resume_command=again)
