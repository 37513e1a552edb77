"""``delft eval``: greedy answers from the base model and adapters, scored side by side.

Generation (batched, left-padded, KV cache) lives in delft.evaluation.generation; extraction, scoring and metrics in
delft.numbers.answers; the settings the command line resolves to and the checks on runs and base in
delft.evaluation.runs (which compare and study share).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from delft.errors import UserError
from delft.evaluation.benchmark import bin_scores, bin_table, heatmap_path, write_heatmap
from delft.evaluation.contamination import counted, generated_exclusion, score_unseen, seen_lines
from delft.evaluation.metrics import EXACT_MATCH, METRICS, PASS_1, SAMPLING, differences, flags, paired_difference
from delft.evaluation.model_scores import evaluate_models
from delft.evaluation.problems import (
    BOOTSTRAP_SEED,
    Problem,
    describe_source,
    load_problems,
    settings_block,
    shows_harness_scores,
)
from delft.evaluation.report import print_teacher, render_table, to_json, write_plot
from delft.evaluation.results import ModelResult
from delft.evaluation.runs import check_backend, check_runs, resolve_settings
from delft.evaluation.sampling import per_problem
from delft.evaluation.teacher_forced import teacher_plot_path, write_teacher_plot
from delft.models.loading import load_tokenizer
from delft.models.sources import resolve_model
from delft.numbers.tokens import NumberVocab
from delft.outputs import check_output_files, write_result


def column_names(runs: Sequence[str], include_base: bool) -> list[str]:
    """'base', then each run's directory name (its path where names repeat)."""
    names = [Path(r).name or str(r) for r in runs]
    out = []
    for r, n in zip(runs, names):
        out.append(str(r) if names.count(n) > 1 or n == "base" else n)
    return (["base"] if include_base else []) + out


def check_teacher_tokenizer(base: str) -> None:
    """--teacher-forced needs number tokens (single digits or Llama-3's 1-3 digit tokens): say so before any
    model answers."""
    NumberVocab.from_tokenizer(load_tokenizer(resolve_model(base).path), purpose="--teacher-forced")


def keep_finished(err: UserError, done: Sequence[ModelResult], problems: Sequence[Problem], settings: dict,
                  json_out: Optional[Path], console: Console) -> UserError:
    """A model that fails after others were evaluated: theirs are shown and, with --json, written (marked
    incomplete), and the error says where they are."""
    if not done:
        return err
    console.print(render_table(done, "delft eval, incomplete: the models evaluated before the error"))
    kept = f"The models evaluated before it ({', '.join(r.name for r in done)}) are in the table above"
    if json_out is not None:
        report = {**to_json(done, problems, settings), "incomplete": str(err)}
        write_result(Path(json_out), json.dumps(report, indent=2), "--json")
        kept += f" and in {json_out} (marked incomplete)"
    return UserError(err.what, err.where, f"{err.fix or ''} {kept}.".strip())


def versus(base: ModelResult, r: ModelResult, resamples: int) -> dict:
    """``r`` minus ``base`` per problem, paired bootstrap: exact and tolerance match (of the voted answers when
    sampled), and with samples pass@1 and pass@K."""
    out = differences(flags(base.scored), flags(r.scored), resamples)
    if base.samples is not None and r.samples is not None:
        a, b = per_problem(base.samples), per_problem(r.samples)
        for m in METRICS:
            if m.block == SAMPLING:
                out[m.key] = paired_difference(a[m.key], b[m.key], resamples, BOOTSTRAP_SEED)
    return out


def difference_line(r: ModelResult) -> str:
    """'NAME vs base: exact match +D points [95 % CI lo, hi] (paired bootstrap)', pass@1 beside it when sampled."""
    def part(label: str, d: dict) -> str:
        ci = d["ci"]
        span = f" [95 % CI {100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
        return f"{label} {100 * d['difference']:+.1f} points{span}"

    voted = "majority-vote " if r.samples is not None else ""
    parts = [part(voted + EXACT_MATCH.name, r.vs_base[EXACT_MATCH.key])]
    if PASS_1.key in r.vs_base:
        parts.append(part(PASS_1.name, r.vs_base[PASS_1.key]))
    return f"{r.name} vs base: {'; '.join(parts)} (paired bootstrap)"


def run_eval(recipe_path: Optional[Path] = None, runs: Sequence[str] = (), model: Optional[str] = None,
             data: Optional[str] = None, data_format: Optional[str] = None, limit: Optional[int] = None,
             include_base: bool = True, json_out: Optional[Path] = None, plot: Optional[Path] = None,
             overrides: Sequence[str] = (), console: Optional[Console] = None,
             teacher_forced: bool = False, allow_seen: bool = False) -> list[ModelResult]:
    """Evaluate the base model (unless ``include_base`` is False) and every run; print, and write JSON / PNG.
    ``teacher_forced`` adds delft.evaluation.teacher_forced's metrics on the gold completions (table, JSON, a second PNG).
    A generated set is drawn without the recipe's and the runs' training problems; a set that is mostly one run's
    training problems is refused unless ``allow_seen`` (delft.evaluation.contamination)."""
    console = console or Console()
    cfg, base, data_cfg, limit, runs = resolve_settings(recipe_path, runs, model, data, data_format, limit,
                                                        overrides, console)
    if not include_base and not runs:
        raise UserError("nothing to evaluate: --no-base and no run directories", "delft eval",
                        "Give run directories, or drop --no-base.")
    check_backend(cfg, base, runs, include_base, teacher_forced)
    check_runs(runs, base)
    check_output_files({"--json": json_out, "--plot": plot})
    if teacher_forced:
        check_teacher_tokenizer(base)
    problems, skipped = load_problems(data_cfg, console, generated_exclusion(
        data_cfg, [cfg.data] if recipe_path is not None else [], [str(r) for r in runs]))
    adapters: list[Optional[str]] = ([None] if include_base else []) + [str(r) for r in runs]
    names = column_names(runs, include_base)
    seen = counted(problems, dict(zip(names, adapters)), f"the eval set ({describe_source(data_cfg)})",
                   "eval.data" if data is None else "--data", allow_seen)
    title = f"delft eval: {len(problems)} problems from {describe_source(data_cfg)}, base model {base}"
    settings = {"base_model": base, "runs": [str(r) for r in runs], "limit": limit,
                **settings_block(data_cfg, cfg, len(problems), skipped), "teacher_forced": teacher_forced,
                "allow_seen": allow_seen}
    done: list[ModelResult] = []
    try:
        results = evaluate_models(list(zip(names, adapters)), base, problems, data_cfg, cfg, console, done,
                                  teacher_forced)
    except UserError as e:
        raise keep_finished(e, done, problems, settings, json_out, console) from None
    for r in results:
        r.contamination = score_unseen(seen[r.name], problems, r.scored)
    if include_base:
        for r in results[1:]:
            r.vs_base = versus(results[0], r, cfg.eval.bootstrap)

    console.print(render_table(results, title, shows_harness_scores(data_cfg, cfg.eval)))
    for r in results[1:] if include_base else []:
        console.print(difference_line(r))
    for line in seen_lines({r.name: r.contamination for r in results}):
        console.print(line, highlight=False)
    if teacher_forced:
        print_teacher(results, include_base, cfg.eval.bootstrap, console)
    benchmark = {r.name: bin_scores(problems, r) for r in results} if data_cfg.format == "nupa" else None
    for name, scores in (benchmark or {}).items():
        console.print(bin_table(name, scores))
    _write_outputs(results, problems, settings, json_out, plot, title, teacher_forced, console, benchmark)
    return results


def _write_outputs(results: Sequence[ModelResult], problems: Sequence[Problem], settings: dict,
                   json_out: Optional[Path], plot: Optional[Path], title: str, teacher_forced: bool,
                   console: Console, benchmark: Optional[dict] = None) -> None:
    """--json and --plot (and with --teacher-forced the second plot; on the number-task benchmark its heatmap and
    its per-bin scores, delft.evaluation.benchmark)."""
    if json_out is not None:
        report = to_json(results, problems, settings)
        if benchmark is not None:
            report["number_tasks"] = benchmark
        write_result(Path(json_out), json.dumps(report, indent=2), "--json")
        console.print(f"[green]wrote[/] {json_out}")
    if plot is not None:
        write_plot(results, Path(plot), title)
        console.print(f"[green]wrote[/] {plot}")
        if benchmark is not None:
            write_heatmap(list(benchmark), list(benchmark.values()), heatmap_path(Path(plot)), title)
            console.print(f"[green]wrote[/] {heatmap_path(Path(plot))}")
        if teacher_forced:
            second = teacher_plot_path(Path(plot))
            write_teacher_plot([r.name for r in results], [r.teacher_metrics for r in results], second,
                               f"teacher-forced on the gold completions: {title}")
            console.print(f"[green]wrote[/] {second}")
