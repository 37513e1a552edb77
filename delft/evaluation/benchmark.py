"""The digit-level benchmark's report (``delft eval --data nupa``): each model's scores per task and length bin.

Every problem of a ``nupa`` set carries its (task, length) bin (delft.data.generated.nupa_examples). Each bin gets
the Number Cookbook's three scores on the answer delft extracted (after the run's own data.numbers form is read
back): exact match, digit match (the share of digit places right, aligned by place) and the mean length difference
(digits predicted minus digits in the gold; answers without a number count 0 for digit match and are left out of
the length difference). The terminal shows exact match as a task x length table per model; the JSON keeps all
three per bin; ``--plot`` adds a heatmap per model beside the per-place bars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich.table import Table

from delft.data import number_tasks
from delft.evaluation.metrics import EXACT_MATCH
from delft.evaluation.problems import Problem
from delft.evaluation.results import ModelResult
from delft.outputs import write_figure


def bin_scores(problems: Sequence[Problem], result: ModelResult) -> dict[str, dict[int, dict]]:
    """task -> length -> {n, exact_match, digit_match, length_difference} for one model."""
    raw: dict[str, dict[int, list]] = {}
    for problem, scored in zip(problems, result.scored):
        item = problem.example.item
        pred, gold = scored.extraction.canonical, problem.example.answer
        raw.setdefault(item["task"], {}).setdefault(item["length"], []).append(
            (number_tasks.exact_match(pred, gold), number_tasks.digit_match(pred, gold),
             number_tasks.length_difference(pred, gold)))
    out: dict[str, dict[int, dict]] = {}
    for task, by_length in raw.items():
        for length, rows in sorted(by_length.items()):
            lengths = [d for _, _, d in rows if d is not None]
            out.setdefault(task, {})[length] = {
                "n": len(rows), EXACT_MATCH.key: sum(e for e, _, _ in rows) / len(rows),
                "digit_match": sum(m for _, m, _ in rows) / len(rows),
                "length_difference": sum(lengths) / len(lengths) if lengths else None}
    return out


def lengths_of(scores: dict[str, dict[int, dict]]) -> list[int]:
    return sorted({length for by_length in scores.values() for length in by_length})


def bin_table(name: str, scores: dict[str, dict[int, dict]]) -> Table:
    """Exact match (%) per task (rows) and length bin (columns) for one model; '-' where a task has no bin."""
    lengths = lengths_of(scores)
    table = Table(title=f"{name}: exact match (%) per number task and operand length (digits)")
    table.add_column("task")
    for length in lengths:
        table.add_column(str(length), justify="right")
    for task, by_length in scores.items():
        table.add_row(task, *[f"{100 * by_length[n][EXACT_MATCH.key]:.0f}" if n in by_length else "-"
                              for n in lengths])
    table.caption = "digit match and the length difference per bin: --json (number_tasks)"
    return table


def heatmap_path(plot: Path) -> Path:
    """Where --plot's benchmark heatmap goes: beside the per-place plot, ``-number-tasks`` added to its name."""
    return plot.with_name(f"{plot.stem}-number-tasks{plot.suffix}")


def write_heatmap(names: Sequence[str], scores: Sequence[dict], path: Path, title: str) -> None:
    """One heatmap per model: exact match by task (rows) and length (columns), 0-100 %."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(dict.fromkeys(t for s in scores for t in s))
    lengths = sorted({n for s in scores for n in lengths_of(s)})
    fig = Figure(figsize=(max(5.0, 0.45 * len(lengths) + 3), 0.4 * len(tasks) * len(names) + 1.5), dpi=120)
    FigureCanvasAgg(fig)
    for k, (name, s) in enumerate(zip(names, scores)):
        ax = fig.add_subplot(len(names), 1, k + 1)
        grid = [[100 * s[t][n][EXACT_MATCH.key] if n in s.get(t, {}) else float("nan") for n in lengths]
                for t in tasks]
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(tasks)))
        ax.set_yticklabels(tasks, fontsize=7)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([str(n) for n in lengths], fontsize=7)
        ax.set_title(name, fontsize=9)
        fig.colorbar(image, ax=ax, label="exact match (%)")
    fig.axes[0].set_xlabel("operand length (digits)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    write_figure(fig, path, "--plot")
