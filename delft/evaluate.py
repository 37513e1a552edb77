"""``delft eval``: greedy answers from the base model and adapters, scored side by side.

Generation (batched, left-padded, KV cache) lives in delft.generate; extraction, scoring and metrics in
delft.answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from delft import __version__
from delft.answers import (Scored, canonical, extract_answer, paired_difference, parse_number, place_order, score,
                           summarize)
from delft.data import EVAL_SEED_OFFSET
from delft.digits import place_name
from delft.errors import UserError
from delft.outputs import check_output_files, write_figure, write_result

BOOTSTRAP_SEED = 0


@dataclass
class Problem:
    """One eval problem: the source example and its numeric gold answer."""

    example: Any  # delft.data.Example
    gold: Decimal
    index: int


@dataclass
class ModelResult:
    name: str
    adapter: Optional[str]
    template: str = "plain"
    stop_strings: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    vs_base: Optional[dict] = None
    teacher: Any = None  # delft.teacher.TeacherForced with --teacher-forced
    teacher_metrics: Optional[dict] = None
    teacher_vs_base: Optional[dict] = None


# ------------------------------------------------------------------------------------------ settings


def resolve_settings(recipe_path: Optional[Path], runs: Sequence[str], model: Optional[str], data: Optional[str],
                     data_format: Optional[str], limit: Optional[int], overrides: Sequence[str],
                     console: Console):
    """(recipe config, base model name, eval DataConfig, limit, runs) from the command line."""
    from pydantic import ValidationError

    from delft.recipe import DataConfig, load_recipe

    cfg = load_recipe(recipe_path, list(overrides))
    runs = list(runs)
    if recipe_path is None:
        if model is None:
            model = _base_from_runs(runs)
        if model is None or data is None:
            missing = " and ".join(x for x, v in (("--model", model), ("--data", data)) if v is None)
            raise UserError(f"without a recipe, {missing} {'is' if ' and ' not in missing else 'are'} required",
                            "delft eval", "Pass a recipe (delft eval RECIPE.yaml [RUNS...]) or e.g. "
                            "--model smollm2-135m --data synthetic (or --data FILE --format gsm8k).")
    model = model or cfg.model.name
    base_data = cfg.eval_data()
    fields = base_data.model_dump()
    if data is not None:
        fields["source"] = data
        if data == "synthetic":
            if data_format not in (None, "synthetic"):
                raise UserError(f"--data synthetic goes with --format synthetic, not {data_format!r}", "--format",
                                "Drop --format.")
            fields["format"] = "synthetic"
        elif data_format is not None:
            fields["format"] = data_format
        elif base_data.format == "synthetic" or recipe_path is None:
            raise UserError(f"--format is required with --data {data}", "--format",
                            "Say how rows map to question and answer: gsm8k, svamp, prompt_completion, chat, ...")
    elif data_format is not None:
        fields["format"] = data_format
    if limit is None:
        limit = cfg.eval.limit
    if limit is not None:
        if limit <= 0:
            raise UserError(f"--limit must be positive, not {limit}", "--limit", "e.g. --limit 100.")
        fields["limit"] = min(limit, fields["limit"]) if fields.get("limit") else limit
    fields["val_size"] = 0
    try:
        data_cfg = DataConfig.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise UserError(f"invalid eval data: {problems}", "--data/--format", "Check --data and --format.") from None
    data_cfg = disjoint_from_training(data_cfg, cfg.data)
    if not runs and recipe_path is not None:
        finished = _finished_run(Path(cfg.output.dir))
        if finished is not None:
            console.print(f"[dim]including the finished run in {finished} (output.dir of the recipe)[/]")
            runs = [str(finished)]
    return cfg, model, data_cfg, limit, runs


def disjoint_from_training(data_cfg, train_data):
    """``data_cfg``, its synthetic seed moved by EVAL_SEED_OFFSET where it would repeat the training problems
    (an eval set equal to them would measure memorisation)."""
    if (data_cfg.source == "synthetic" and train_data.source == "synthetic"
            and data_cfg.synthetic.seed == train_data.synthetic.seed):
        data_cfg.synthetic = data_cfg.synthetic.model_copy(update={"seed": data_cfg.synthetic.seed + EVAL_SEED_OFFSET})
    return data_cfg


def _base_from_runs(runs: Sequence[str]) -> Optional[str]:
    from delft.rundir import base_model

    bases = {base_model(Path(r)) for r in runs if Path(r).is_dir()}
    bases.discard(None)
    return bases.pop() if len(bases) == 1 else None


def _finished_run(path: Path) -> Optional[Path]:
    from delft.rundir import is_finished_run

    return path if is_finished_run(path) else None


def check_runs(runs: Sequence[str], base: str) -> None:
    """Fail before any generation: every run must exist and be an adapter or a merged model for ``base``."""
    from delft.models import resolve_model
    from delft.rundir import (ADAPTER_CONFIG, MODEL_CONFIG, check_adapter_matches, check_model_files,
                              is_merged_model, read_info)

    base_config = None
    for run in runs:
        p = Path(run)
        if not p.exists():
            raise UserError(f"run directory {run} does not exist", "delft eval",
                            "Give a directory written by `delft train` (or by `delft export`).")
        if not p.is_dir():
            raise UserError(f"{run} is a file, not a run directory", "delft eval",
                            "Give a directory written by `delft train` (or by `delft export`).")
        adapter = p.is_dir() and (p / ADAPTER_CONFIG).is_file()
        if not adapter and not is_merged_model(p):
            raise UserError(f"{run} holds neither an adapter ({ADAPTER_CONFIG}) nor a merged model ({MODEL_CONFIG})",
                            "delft eval", "Give a run directory written by `delft train` or a merged model.")
        check_model_files(p, "delft eval", "Restore the file, or train (or export) that run again.")
        if adapter and read_info(p).get("architecture"):
            if base_config is None:
                from transformers import AutoConfig

                try:
                    base_config = AutoConfig.from_pretrained(resolve_model(base).path)
                except (OSError, ValueError):
                    return  # load_for_inference reports it
            check_adapter_matches(p, base, base_config, "delft eval")


def column_names(runs: Sequence[str], include_base: bool) -> list[str]:
    """'base', then each run's directory name (its path where names repeat)."""
    names = [Path(r).name or str(r) for r in runs]
    out = []
    for r, n in zip(runs, names):
        out.append(str(r) if names.count(n) > 1 or n == "base" else n)
    return (["base"] if include_base else []) + out


def load_problems(data_cfg, console: Console) -> tuple[list[Problem], int]:
    """The eval problems with numeric gold answers; (problems, number skipped for lack of an answer)."""
    from delft.data import load_examples

    examples = load_examples(data_cfg, "eval.data")
    problems, skipped = [], 0
    for i, ex in enumerate(examples):
        gold = parse_number(ex.answer) if ex.answer is not None else parse_number(ex.completion)
        if gold is None:
            skipped += 1
            continue
        problems.append(Problem(ex, gold, i))
    if not problems:
        raise UserError(f"the eval set ({data_cfg.source}, format {data_cfg.format}) has no numeric answers: none "
                        f"of its {len(examples)} examples has an 'answer' field or a completion that is a number",
                        "eval.data", "Use a format with answers (gsm8k, svamp, synthetic), or add an 'answer' "
                        "column to a prompt_completion / chat file.")
    if skipped:
        console.print(f"[yellow]warning:[/] skipped {skipped} of {len(examples)} eval examples without a numeric "
                      "answer")
    return problems, skipped


# ---------------------------------------------------------------------------------------- generation


def evaluate_model(name: str, base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg,
                   recipe_cfg, progress=None, task=None, teacher_forced: bool = False) -> ModelResult:
    """Load one model, answer every problem, score the answers (and with ``teacher_forced`` score the gold
    completions, delft.teacher); the model is freed afterwards."""
    from delft.data import render_prompt, use_chat_template
    from delft.generate import free_memory, greedy, stop_strings
    from delft.models import load_for_inference

    model, tokenizer = load_for_inference(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype)
    try:
        chat = use_chat_template(tokenizer, data_cfg)
        stops = stop_strings(tokenizer, chat)
        prompts = [render_prompt(p.example, tokenizer, data_cfg) for p in problems]
        advance = (lambda n: progress.advance(task, n)) if progress is not None else None
        generations = greedy(model, tokenizer, prompts, recipe_cfg.eval.max_new_tokens, chat,
                             recipe_cfg.eval.batch_size, on_batch=advance)
        teacher = _teacher_forced(model, tokenizer, problems, data_cfg, recipe_cfg) if teacher_forced else None
    finally:
        del model
        free_memory()
    generated = [g.text for g in generations]
    scored = [score(extract_answer(text, stops), p.gold) for text, p in zip(generated, problems)]
    return ModelResult(name, adapter, "chat" if chat else "plain", stops, prompts, generated, scored,
                       teacher=teacher)


def _teacher_forced(model, tokenizer, problems: Sequence[Problem], data_cfg, recipe_cfg):
    from delft.digits import DigitVocab
    from delft.teacher import teacher_forced

    vocab = DigitVocab.from_tokenizer(tokenizer, purpose="--teacher-forced")
    return teacher_forced(model, tokenizer, [p.example for p in problems], data_cfg, vocab,
                          recipe_cfg.eval.batch_size)


def score_gold(base: str, adapter: Optional[str], problems: Sequence[Problem], data_cfg, recipe_cfg):
    """Load one model, score the gold completions of ``problems`` teacher-forced (no generation), free it."""
    from delft.generate import free_memory
    from delft.models import load_for_inference

    model, tokenizer = load_for_inference(base, adapter, device=recipe_cfg.model.device, dtype=recipe_cfg.model.dtype)
    try:
        return _teacher_forced(model, tokenizer, problems, data_cfg, recipe_cfg)
    finally:
        del model
        free_memory()


def progress_bar(console: Console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def evaluate_models(columns: Sequence[tuple[str, Optional[str]]], base: str, problems: Sequence[Problem], data_cfg,
                    recipe_cfg, console: Console, done: Optional[list] = None,
                    teacher_forced: bool = False) -> list[ModelResult]:
    """Every (name, adapter) column in turn (one model in memory at a time), answered, scored and summarised.

    Each finished result is appended to ``done`` (when given) at once, so a later failure cannot lose it.
    """
    results = [] if done is None else done
    with progress_bar(console) as progress:
        for name, adapter in columns:
            task = progress.add_task(name, total=len(problems))
            r = evaluate_model(name, base, adapter, problems, data_cfg, recipe_cfg, progress, task, teacher_forced)
            r.metrics = summarize(r.scored, recipe_cfg.eval.bootstrap, BOOTSTRAP_SEED)
            if r.teacher is not None:
                from delft.teacher import summarize_teacher

                r.teacher_metrics = summarize_teacher(r.teacher)
            results.append(r)
    return results


# ------------------------------------------------------------------------------------------ differences


def flags(scored: Sequence[Scored]) -> tuple[list[float], list[float]]:
    """(exact, tolerance) match per problem, as 0/1."""
    return [float(s.exact) for s in scored], [float(s.tolerance) for s in scored]


def differences(a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]],
                resamples: int) -> dict:
    """b minus a in exact and tolerance match (paired bootstrap over the same problems): ``flags`` pairs, or
    per-problem rates averaged over seeds."""
    return {"exact_match": paired_difference(a[0], b[0], resamples, BOOTSTRAP_SEED),
            "tolerance_match": paired_difference(a[1], b[1], resamples, BOOTSTRAP_SEED)}


def describe_source(data_cfg) -> str:
    return data_cfg.source if data_cfg.source != "synthetic" else f"synthetic (seed {data_cfg.synthetic.seed})"


def settings_block(data_cfg, recipe_cfg, n: int, skipped: int) -> dict:
    """How an eval set was answered and scored (the JSON's settings; compare adds its own keys)."""
    return {
        "data": data_cfg.model_dump(mode="json"),
        "n": n,
        "skipped_without_answer": skipped,
        "decoding": "greedy",
        "max_new_tokens": recipe_cfg.eval.max_new_tokens,
        "batch_size": recipe_cfg.eval.batch_size,
        "bootstrap": {"resamples": recipe_cfg.eval.bootstrap, "seed": BOOTSTRAP_SEED, "level": 0.95},
        "device": recipe_cfg.model.device,
        "dtype": recipe_cfg.model.dtype,
    }


# ------------------------------------------------------------------------------------------ rendering


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1e6 else f"{x:.3e}"


def metric_rows(results: Sequence[ModelResult]) -> list[tuple[str, list[Optional[float]], list[str], bool]]:
    """(label, values, cells, higher_is_better) per table row."""
    rows = []
    m = [r.metrics for r in results]

    def ci_cell(x, key):
        ci = x.get(key)
        return _pct(x[key.removesuffix("_ci")]) + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")

    rows.append(("exact match (95 % CI)", [x["exact_match"] for x in m], [ci_cell(x, "exact_match_ci") for x in m],
                 True))
    rows.append(("tolerance match (95 % CI)", [x["tolerance_match"] for x in m],
                 [ci_cell(x, "tolerance_match_ci") for x in m], True))
    rows.append(("no number", [x["no_number_rate"] for x in m], [_pct(x["no_number_rate"]) for x in m], False))
    rows.append(("MAE", [x["mae"] for x in m], [_num(x["mae"]) for x in m], False))
    rows.append(("log-MAE", [x["log_mae"] for x in m], [_num(x["log_mae"]) for x in m], False))
    rows.append(("digit accuracy (all places)", [x["digit_accuracy"] for x in m], [_pct(x["digit_accuracy"]) for x in m],
                 True))
    places = place_order(p["place"] for x in m for p in x["per_place"].values())
    for place in places:
        name = place_name(place)
        vals = [x["per_place"].get(name, {}).get("accuracy") for x in m]
        n = max(x["per_place"].get(name, {}).get("n", 0) for x in m)
        rows.append((f"  {name} (n={n})", vals, [_pct(v) for v in vals], True))
    return rows


def render_table(results: Sequence[ModelResult], title: str) -> Table:
    """Models as columns, metrics as rows, the best value of each row in bold green."""
    table = _table(results, title, metric_rows(results))
    table.caption = ("exact: numeric equality; tolerance: integer gold needs round(pred) == gold, other gold 4 % "
                     "relative error (DEL paper); digit places of the gold number, a missing place or no number "
                     "counts wrong; MAE and log-MAE over answers with a number")
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
    }


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
                **({"teacher_forced": {**r.teacher_metrics, "vs_base": r.teacher_vs_base}}
                   if r.teacher_metrics is not None else {}),
                "predictions": [prediction_record(p, pr, g, s)
                                for p, pr, g, s in zip(problems, r.prompts, r.generated, r.scored)],
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


def check_teacher_tokenizer(base: str) -> None:
    """--teacher-forced needs single-token digits: say so before any model answers."""
    from delft.digits import DigitVocab
    from delft.models import load_tokenizer, resolve_model

    DigitVocab.from_tokenizer(load_tokenizer(resolve_model(base).path), purpose="--teacher-forced")


def print_teacher(results: Sequence[ModelResult], include_base: bool, resamples: int, console: Console) -> None:
    """The teacher-forced table (same layout as the main one) and each run's differences from the base."""
    from delft.teacher import difference_line, teacher_differences, teacher_rows

    if include_base:
        for r in results[1:]:
            r.teacher_vs_base = teacher_differences(results[0].teacher, r.teacher, resamples, BOOTSTRAP_SEED)
    first = results[0].teacher_metrics
    title = (f"teacher-forced on the gold completions of {first['n_examples']} problems"
             + (f" ({first['truncated']} truncated at data.max_length)" if first["truncated"] else ""))
    table = _table(results, title, teacher_rows([r.teacher_metrics for r in results]))
    table.caption = ("at each digit of the gold completion: argmax among the ten digits, full-vocabulary argmax, "
                     "CE over the ten digit logits; non-digit CE / perplexity: every other completion token")
    table.caption_justify = "left"
    console.print(table)
    for r in results[1:] if include_base else []:
        console.print(difference_line(r.name, r.teacher_vs_base))


# ---------------------------------------------------------------------------------------------- entry


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



def run_eval(recipe_path: Optional[Path] = None, runs: Sequence[str] = (), model: Optional[str] = None,
             data: Optional[str] = None, data_format: Optional[str] = None, limit: Optional[int] = None,
             include_base: bool = True, json_out: Optional[Path] = None, plot: Optional[Path] = None,
             overrides: Sequence[str] = (), console: Optional[Console] = None,
             teacher_forced: bool = False) -> list[ModelResult]:
    """Evaluate the base model (unless ``include_base`` is False) and every run; print, and write JSON / PNG.
    ``teacher_forced`` adds delft.teacher's metrics on the gold completions (table, JSON, a second PNG)."""
    console = console or Console()
    cfg, base, data_cfg, limit, runs = resolve_settings(recipe_path, runs, model, data, data_format, limit,
                                                        overrides, console)
    if not include_base and not runs:
        raise UserError("nothing to evaluate: --no-base and no run directories", "delft eval",
                        "Give run directories, or drop --no-base.")
    check_runs(runs, base)
    check_output_files({"--json": json_out, "--plot": plot})
    if teacher_forced:
        check_teacher_tokenizer(base)
    problems, skipped = load_problems(data_cfg, console)
    adapters: list[Optional[str]] = ([None] if include_base else []) + [str(r) for r in runs]
    title = f"delft eval: {len(problems)} problems from {describe_source(data_cfg)}, base model {base}"
    settings = {"base_model": base, "runs": [str(r) for r in runs], "limit": limit,
                **settings_block(data_cfg, cfg, len(problems), skipped), "teacher_forced": teacher_forced}
    done: list[ModelResult] = []
    try:
        results = evaluate_models(list(zip(column_names(runs, include_base), adapters)), base, problems, data_cfg,
                                  cfg, console, done, teacher_forced)
    except UserError as e:
        raise keep_finished(e, done, problems, settings, json_out, console) from None
    if include_base:
        for r in results[1:]:
            r.vs_base = differences(flags(results[0].scored), flags(r.scored), cfg.eval.bootstrap)

    console.print(render_table(results, title))
    for r in results[1:] if include_base else []:
        d = r.vs_base["exact_match"]
        ci = d["ci"]
        span = f" [95 % CI {100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
        console.print(f"{r.name} vs base: exact match {100 * d['difference']:+.1f} points{span} (paired bootstrap)")
    if teacher_forced:
        print_teacher(results, include_base, cfg.eval.bootstrap, console)

    if json_out is not None:
        write_result(Path(json_out), json.dumps(to_json(results, problems, settings), indent=2), "--json")
        console.print(f"[green]wrote[/] {json_out}")
    if plot is not None:
        write_plot(results, Path(plot), title)
        console.print(f"[green]wrote[/] {plot}")
        if teacher_forced:
            from delft.teacher import teacher_plot_path, write_teacher_plot

            second = teacher_plot_path(Path(plot))
            write_teacher_plot([r.name for r in results], [r.teacher_metrics for r in results], second,
                               f"teacher-forced on the gold completions: {title}")
            console.print(f"[green]wrote[/] {second}")
    return results
