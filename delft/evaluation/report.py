"""How `delft eval` shows and saves its results: the metrics table (rich), per-problem records, the JSON
report and the bar plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from delft import __version__
from delft.evaluation.metrics import (
    FLEXIBLE_EXTRACT,
    METRICS,
    SAMPLING,
    STRICT_MATCH,
    TASK_SCORE,
    Metric,
    metric_value,
    place_order,
)
from delft.evaluation.problems import BOOTSTRAP_SEED, Problem
from delft.evaluation.results import ModelResult
from delft.evaluation.teacher_forced import difference_line, teacher_differences, teacher_rows
from delft.numbers.answers import Scored, canonical
from delft.numbers.digits import place_name
from delft.outputs import num, pct, write_figure


def _ci_cell(x: dict, key: str) -> str:
    """``x[key]`` as a percentage with its 95 % interval ``x[key + '_ci']``."""
    ci = x.get(f"{key}_ci")
    return pct(x[key]) + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def _cell(m: Metric, block: dict) -> str:
    """``m``'s cell from the part of one model's metrics that holds it; empty where the model has no such part."""
    if not block:
        return ""
    if m.interval:
        return _ci_cell(block, m.key)
    return pct(block.get(m.key)) if m.rate else num(block.get(m.key), m.fmt)


def _shown(m: Metric, metrics: Sequence[dict], k: Optional[int], harness: bool) -> bool:
    """Whether delft eval's table has ``m``'s row (Metric.only)."""
    if m.only == "sampled":
        return bool(k)
    if m.only == "harness":
        return harness
    if m.only == "set":
        return any(metric_value(x, m) is not None for x in metrics)
    return True


def metric_rows(results: Sequence[ModelResult], harness: bool = False
                ) -> list[tuple[str, list[Optional[float]], list[str], bool]]:
    """(label, values, cells, higher_is_better) per table row: every row of METRICS the results have (``harness``
    adds lm-evaluation-harness's GSM8K scores, sampled results their pass@k rows), then per-place accuracy."""
    rows = []
    m = [r.metrics for r in results]
    s = [x.get(SAMPLING) or {} for x in m]  # a seed mean of compare has none: its cells stay empty
    k = next((x["k"] for x in s if x), None)
    voted = f"majority of {k} " if k else ""
    for metric in METRICS:
        if _shown(metric, m, k, harness):
            blocks = [x.get(metric.block) or {} for x in m] if metric.block else m
            rows.append(((voted if metric.voted else "") + metric.label.format(k=k),
                         [metric_value(x, metric) for x in m], [_cell(metric, b) for b in blocks],
                         metric.higher_is_better))
    places = place_order(p["place"] for x in m for p in x["per_place"].values())
    for place in places:
        name = place_name(place)
        vals = [x["per_place"].get(name, {}).get("accuracy") for x in m]
        n = max(x["per_place"].get(name, {}).get("n", 0) for x in m)
        rows.append((f"  {name} (n={n})", vals, [pct(v) for v in vals], True))
    return rows


def render_table(results: Sequence[ModelResult], title: str, harness: bool = False) -> Table:
    """Models as columns, metrics as rows, the best value of each row in bold green."""
    table = _table(results, title, metric_rows(results, harness))
    table.caption = ("exact: numeric equality; tolerance: integer gold needs round(pred) == gold, other gold 4 % "
                     "relative error (DEL paper); digit places of the gold number, a missing place or no number "
                     "counts wrong; MAE and log-MAE over answers with a number"
                     + ("; strict-match / flexible-extract: lm-evaluation-harness's GSM8K string match of the "
                        "number after '#### ' / of the last number" if harness else "")
                     + ("; with samples every row but pass@k scores the majority-vote answer"
                        if results and results[0].samples is not None else ""))
    table.caption_justify = "left"
    return table


def _table(results: Sequence[ModelResult], title: str, rows) -> Table:
    """``rows`` of (label, values, cells, higher_is_better) with models as columns, each row's best in green."""
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("metric", style="cyan", no_wrap=True)
    for r in results:
        table.add_column(r.name, justify="right")
    for label, values, cells, higher in rows:
        present = [v for v in values if v is not None]
        best = None
        if len(present) > 1 and max(present) - min(present) > 1e-12:  # nothing to highlight when all tie
            best = max(present) if higher else min(present)
        styled = [f"[bold green]{c}[/]" if best is not None and v is not None and abs(v - best) < 1e-12 else c
                  for v, c in zip(values, cells)]
        table.add_row(label, *styled)
    return table


def prediction_record(p: Problem, prompt: str, generated: str, s: Scored) -> dict:
    e = s.extraction
    return {
        "index": p.index,
        "prompt": prompt,
        "gold": canonical(p.gold),
        "generated": generated,
        "extracted": e.canonical,
        "matched_text": e.text,
        "rule": e.rule,
        "exact": s.exact,
        "tolerance": s.tolerance,
        "places": {place_name(k): v for k, v in sorted(s.places.items(), key=lambda kv: -kv[0])},
        STRICT_MATCH.key: s.strict,
        FLEXIBLE_EXTRACT.key: s.flexible,
        **({TASK_SCORE.key: s.task_score} if s.task_score is not None else {}),
    }


def predictions(r: ModelResult, problems: Sequence[Problem], prompts: bool = True) -> list[dict]:
    """Every prediction of one model (with its samples when sampled); ``prompts`` False leaves the rendered
    prompt out (compare records it once per set)."""
    out = []
    for i, (p, pr, g, s) in enumerate(zip(problems, r.prompts, r.generated, r.scored)):
        rec = prediction_record(p, pr, g, s)
        if not prompts:
            del rec["prompt"]
        if r.samples:
            rec["samples"] = sample_records(r.sample_texts[i], r.samples[i])
        out.append(rec)
    return out


def sample_records(texts: Sequence[str], scored: Sequence[Scored]) -> list[dict]:
    """Every sample of one problem: its text, number and exactness."""
    return [{"generated": t, "extracted": s.extraction.canonical, "exact": s.exact} for t, s in zip(texts, scored)]


def to_json(results: Sequence[ModelResult], problems: Sequence[Problem], settings: dict) -> dict:
    return {
        "delft_version": __version__,
        "settings": settings,
        "models": [
            {
                "name": r.name,
                "adapter": r.adapter,
                "template": r.template,
                "stop_strings": r.stop_strings,
                "metrics": r.metrics,
                "vs_base": r.vs_base,
                "contamination": r.contamination,
                **({"teacher_forced": {**r.teacher_metrics, "vs_base": r.teacher_vs_base}}
                   if r.teacher_metrics is not None else {}),
                "predictions": predictions(r, problems),
            }
            for r in results
        ],
    }


def write_plot(results: Sequence[ModelResult], path: Path, title: str, flag: str = "--plot") -> None:
    """Grouped bars: per-place digit accuracy, one colour per model (matplotlib's Agg canvas, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    places = place_order(p["place"] for r in results for p in r.metrics["per_place"].values())
    names = [place_name(p) for p in places]
    counts = [max(r.metrics["per_place"].get(n, {}).get("n", 0) for r in results) for n in names]
    fig = Figure(figsize=(max(5.0, 1.1 * len(places) + 2), 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        vals = [100 * (r.metrics["per_place"].get(n, {}).get("accuracy") or 0.0) for n in names]
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(places))]
        ax.bar(xs, vals, width=width, label=r.name)
    ax.set_xticks(range(len(places)))
    ax.set_xticklabels([f"{n}\n(n={c})" for n, c in zip(names, counts)], fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("digit accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(fig, path, flag)


def teacher_table(results: Sequence[ModelResult], title: str) -> Table:
    """The teacher-forced table (each result's ``teacher_metrics``; same layout as the main one)."""
    table = _table(results, title, teacher_rows([r.teacher_metrics for r in results]))
    table.caption = ("at each digit of the gold completion: argmax among the ten digits, full-vocabulary argmax, "
                     "CE over the ten digit logits; non-digit CE / perplexity: every other completion token")
    table.caption_justify = "left"
    return table


def print_teacher(results: Sequence[ModelResult], include_base: bool, resamples: int, console: Console) -> None:
    """The teacher-forced table and each run's differences from the base."""
    if include_base:
        for r in results[1:]:
            r.teacher_vs_base = teacher_differences(results[0].teacher, r.teacher, resamples, BOOTSTRAP_SEED)
    first = results[0].teacher_metrics
    title = (f"teacher-forced on the gold completions of {first['n_examples']} problems"
             + (f" ({first['truncated']} truncated at data.max_length)" if first["truncated"] else ""))
    console.print(teacher_table(results, title))
    for r in results[1:] if include_base else []:
        console.print(difference_line(r.name, r.teacher_vs_base))
