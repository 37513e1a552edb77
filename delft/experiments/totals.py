"""What ``delft compare`` and ``delft study`` will do, said before they do it: every (recipe, seed) run, whether it
is finished (reused), resumes from a checkpoint or trains from the start, and the steps left in all. Printed up
front by both commands (a log file shows the size of the job before hours of training) and, with ``--plan``,
instead of running. Nothing is trained, read beyond the run folders' markers, or written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from delft.rundir import RUN_INFO, checkpoint_step, has_files, is_finished_run, latest_checkpoint, read_info


@dataclass
class PlannedRun:
    name: str  # recipe-seedN
    run_dir: Path
    steps: Optional[int]  # train.max_steps; None where train.epochs sets it (known once the data is read)
    state: str  # "finished", "resume", "train", "not a run"
    done: int = 0  # steps a finished run took or a checkpoint holds

    @property
    def left(self) -> Optional[int]:
        """Steps still to train (0 for a finished run; None where the total waits on the data)."""
        if self.state == "finished":
            return 0
        return None if self.steps is None else max(0, self.steps - self.done)


def planned_runs(contenders: Sequence, seeds: Sequence[int]) -> list[PlannedRun]:
    """Every (recipe, seed) run in train_all's order, with what is already on disk at its place."""
    runs = []
    for seed in seeds:
        for c in contenders:
            cfg = c.for_seed(seed)
            run_dir = Path(cfg.output.dir)
            run = PlannedRun(f"{c.name}-seed{seed}", run_dir, cfg.train.max_steps, "train")
            if is_finished_run(run_dir):
                run.state, run.done = "finished", int(read_info(run_dir).get("step") or 0)
            elif latest_checkpoint(run_dir) is not None:
                run.state, run.done = "resume", checkpoint_step(latest_checkpoint(run_dir))
            elif has_files(run_dir) and not (run_dir / RUN_INFO).is_file():
                run.state = "not a run"
            runs.append(run)
    return runs


def totals_line(runs: Sequence[PlannedRun], arms: int, seeds: int) -> str:
    """One sentence: how many runs, how many to train or resume, and their steps."""
    todo = [r for r in runs if r.state in ("train", "resume")]
    known = [r.left for r in todo if r.left is not None]
    steps = f"{sum(known):,} steps" if len(known) == len(todo) else (
        f"{sum(known):,} steps" + (" + " if known else "") + f"{len(todo) - len(known)} run(s) of train.epochs "
        "(their steps are counted once the data is read)")
    parts = [f"{len(runs)} runs ({arms} recipes x {seeds} seed{'s' if seeds != 1 else ''})"]
    parts.append(f"{len(todo)} to train or resume: {steps}" if todo else "nothing to train")
    finished = sum(r.state == "finished" for r in runs)
    if finished:
        parts.append(f"{finished} finished, reused")
    blocked = sum(r.state == "not a run" for r in runs)
    if blocked:
        parts.append(f"{blocked} folder(s) in the way that are no delft run (refused when the command runs)")
    return "; ".join(parts)


def _state_text(run: PlannedRun) -> str:
    if run.state == "finished":
        return f"finished at step {run.done}, reused"
    if run.state == "resume":
        return f"resumes from step {run.done}"
    return "folder in the way (no delft run)" if run.state == "not a run" else "trains from the start"


def show_runs(runs: Sequence[PlannedRun], console: Console, title: str) -> None:
    """The runs as a table: folder (named recipe-seedN), what happens to it, steps in all and left."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("run folder", overflow="fold")  # whole: a cut path names another run
    for column in ("state", "steps", "left"):
        table.add_column(column, justify="left" if column == "state" else "right")
    for r in runs:
        left = "?" if r.left is None else f"{r.left:,}"
        table.add_row(str(r.run_dir), _state_text(r), "epochs" if r.steps is None else f"{r.steps:,}", left)
    console.print(table)


def study_totals(study, contenders: Sequence, runs: Sequence[PlannedRun]) -> str:
    """A study's size in one line: runs, steps to train, and the sets every model answers."""
    return (f"[bold]delft study[/]: {totals_line(runs, len(contenders), len(study.seeds))}; then the base model and "
            f"{len(runs)} runs answer {len(study.evals)} set(s): " + ", ".join(
                f"{k} ({v.limit} problems)" if v.limit else k for k, v in study.evals.items()))


def own_results_as_pilot(study, console: Console) -> None:
    """With no spread stated, the study's own earlier results (out/study.json) serve --plan as its pilot, said so:
    a plan for rerunning a study, or for adding seeds to it, is what its seeds showed."""
    own = Path(study.out) / "study.json"  # delft.experiments.study.STUDY_JSON, which imports this module
    if study.plan.seed_spread is None and study.plan.pilot is None and own.is_file():
        study.plan.pilot = str(own.resolve())
        console.print(f"[yellow]note:[/] the study file states no plan.seed_spread or plan.pilot, so its own results "
                      f"{own} serve as the pilot (the spread its seeds showed; state plan.pilot to plan from another)",
                      highlight=False)
