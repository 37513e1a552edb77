"""The stages of training (``STAGES``, one per value of train.stage) and ``run_training``, which checks what is cheap
to check and hands the recipe's stage to the run lifecycle every stage shares (delft.training.run). ``delft train``
(delft.training.command), compare's and study's arms (delft.experiments.arms) and library callers all train here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console

from delft.recipe.schema import Recipe
from delft.training import distributed as dist
from delft.training import grpo, sft
from delft.training.precheck import check_before_loading, note_busy_machine
from delft.training.run import Stage, run_stage


def _no_checks(recipe: Recipe) -> None:
    """SFT refuses nothing beyond what every stage checks before loading (delft.training.precheck)."""


STAGES = {
    "sft": Stage(check=_no_checks, load=sft.load),
    "grpo": Stage(check=grpo.check, load=grpo.load, signals_wait=True),  # TRL's loop: stopped at a step's end
}


def run_training(recipe: Recipe, resume: Optional[bool] = None, force: bool = False,
                 console: Optional[Console] = None, resume_command: str = "delft train RECIPE.yaml") -> Path:
    """Train ``recipe`` into its output.dir: a fresh run, a resume (``resume`` None: when a checkpoint is there)
    or, with ``force``, a replaced earlier run. Returns the run directory."""
    stage = STAGES[recipe.train.stage]
    check_before_loading(recipe)  # what would otherwise be refused only once the model has loaded
    if dist.is_main():
        note_busy_machine(recipe.model.device, console or Console())
    stage.check(recipe)
    dist.start(recipe.model.device)
    console = dist.rank_console(console or Console())
    return run_stage(recipe, stage, resume, force, console, resume_command)
