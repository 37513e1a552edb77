"""``delft eval``: greedy answers from the base model and adapters, scored side by side.

Generation (batched, left-padded, KV cache) lives in delft.evaluation.generation; extraction, scoring and metrics in
delft.numbers.answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from delft.errors import UserError
from delft.evaluation.metrics import differences, flags
from delft.evaluation.problems import (
    BOOTSTRAP_SEED,
    Problem,
    describe_source,
    disjoint_from_training,
    load_problems,
    settings_block,
    shows_harness_scores,
)
from delft.evaluation.report import print_teacher, render_table, to_json, write_plot
from delft.evaluation.results import ModelResult
from delft.evaluation.model_scores import evaluate_models
from delft.outputs import check_output_files, write_result
from delft.rundir import check_trained_dir


def resolve_settings(recipe_path: Optional[Path], runs: Sequence[str], model: Optional[str], data: Optional[str],
                     data_format: Optional[str], limit: Optional[int], overrides: Sequence[str],
                     console: Console):
    """(recipe config, base model name, eval DataConfig, limit, runs) from the command line."""
    from pydantic import ValidationError

    from delft.recipe.schema import GENERATED, DataConfig
    from delft.recipe.files import load_recipe

    cfg = load_recipe(recipe_path, list(overrides))
    runs = list(runs)
    for run in runs:  # named before anything else: a mistyped path is the likeliest mistake, whatever else is missing
        if not Path(run).exists():
            raise UserError(f"{run} does not exist", "delft eval", "Give run directories written by `delft train`, "
                            "merged models from `delft export` or .gguf files (after the recipe, if any).")
    if recipe_path is None:
        if model is None:
            model = _base_from_runs(runs)
        if model is None or data is None:
            missing = " and ".join(x for x, v in (("--model", model), ("--data", data)) if v is None)
            raise UserError(f"without a recipe, {missing} {'is' if ' and ' not in missing else 'are'} required",
                            "delft eval", "Pass a recipe (delft eval RECIPE.yaml [RUNS...]) or e.g. "
                            "--model smollm2-135m --data synthetic (or --data FILE --format gsm8k).")
    if model is None:
        from delft.models.scratch import base_name

        model = base_name(cfg)
    base_data = cfg.eval_data()
    fields = base_data.model_dump()
    if data is not None:
        fields["source"] = data
        if data in GENERATED:
            if data_format not in (None, data):
                raise UserError(f"--data {data} goes with --format {data}, not {data_format!r}", "--format",
                                "Drop --format.")
            fields["format"] = data
        elif data_format is not None:
            fields["format"] = data_format
        elif base_data.format in GENERATED or recipe_path is None:
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
        runs = _recipe_run(Path(cfg.output.dir), console)
    return cfg, model, data_cfg, limit, runs


def _base_from_runs(runs: Sequence[str]) -> Optional[str]:
    from delft.rundir import base_model

    bases = {base_model(Path(r)) for r in runs if Path(r).is_dir()}
    bases.discard(None)
    return bases.pop() if len(bases) == 1 else None


def _recipe_run(path: Path, console: Console) -> list[str]:
    """The recipe's own run (output.dir) as the one run to evaluate when it is finished; when it is not, one line
    says why it is left out, so a table without it is never a surprise."""
    from delft.rundir import is_finished_run, status

    if is_finished_run(path):
        console.print(f"[dim]including the finished run in {path} (output.dir of the recipe)[/]")
        return [str(path)]
    if not path.exists():
        why = "does not exist (not trained yet?)"
    elif status(path) not in (None, "completed"):
        why = f"is not finished (its status is {status(path)!r}: resume the training to finish it)"
    else:
        why = "holds no trained adapter or model"
    console.print(f"[dim]not including the recipe's run: {path} (output.dir) {why}; give run directories after the "
                  "recipe to evaluate them[/]", highlight=False)
    return []


def check_runs(runs: Sequence[str], base: str) -> None:
    """Fail before any generation: every run must exist and be an adapter or a merged model for ``base``."""
    from delft.models.sources import resolve_model
    from delft.rundir import (
        check_adapter_matches,
        read_info,
    )

    from delft.evaluation.gguf_backend import check_gguf, is_gguf

    base_config = None
    for run in runs:
        p = Path(run)
        if is_gguf(run):
            check_gguf(p, "delft eval")
            continue
        adapter = check_trained_dir(p, "delft eval") == "adapter"
        if adapter and read_info(p).get("architecture"):
            if base_config is None:
                from transformers import AutoConfig

                try:
                    base_config = AutoConfig.from_pretrained(resolve_model(base).path)
                except (OSError, ValueError):
                    return  # load_for_inference reports it
            check_adapter_matches(p, base, base_config, "delft eval")


def check_backend(cfg, base: str, runs: Sequence[str], include_base: bool, teacher_forced: bool) -> None:
    """eval.backend llama.cpp needs a .gguf base; --teacher-forced needs transformers' logits for every column."""
    from delft.evaluation.gguf_backend import check_gguf, is_gguf

    llama_base = cfg.eval.backend == "llama.cpp"
    if llama_base and not is_gguf(base):
        raise UserError(f"--backend llama.cpp runs a .gguf model, and the base model is {base}", "--backend",
                        "Pass --model FILE.gguf, or give GGUF files as runs (they always run in llama.cpp).")
    if llama_base and include_base:
        check_gguf(Path(base), "--model")
    gguf = [r for r in runs if is_gguf(r)] + ([base] if llama_base and include_base else [])
    if teacher_forced and gguf:
        raise UserError(f"--teacher-forced reads transformers' logits, and {', '.join(map(str, gguf))} would run in "
                        "llama.cpp", "--teacher-forced", "Drop --teacher-forced, or evaluate the merged model "
                        "directory (delft export) instead of its GGUF.")


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
    from delft.models.loading import load_tokenizer
    from delft.models.sources import resolve_model
    from delft.numbers.tokens import NumberVocab

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
        from delft.evaluation.metrics import paired_difference
        from delft.evaluation.sampling import per_problem

        a, b = per_problem(base.samples), per_problem(r.samples)
        for key in ("pass@1", "pass@k"):
            out[key] = paired_difference(a[key], b[key], resamples, BOOTSTRAP_SEED)
    return out


def difference_line(r: ModelResult) -> str:
    """'NAME vs base: exact match +D points [95 % CI lo, hi] (paired bootstrap)', pass@1 beside it when sampled."""
    def part(label: str, d: dict) -> str:
        ci = d["ci"]
        span = f" [95 % CI {100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
        return f"{label} {100 * d['difference']:+.1f} points{span}"

    parts = [part("majority-vote exact match" if r.samples is not None else "exact match", r.vs_base["exact_match"])]
    if "pass@1" in r.vs_base:
        parts.append(part("pass@1", r.vs_base["pass@1"]))
    return f"{r.name} vs base: {'; '.join(parts)} (paired bootstrap)"


def run_eval(recipe_path: Optional[Path] = None, runs: Sequence[str] = (), model: Optional[str] = None,
             data: Optional[str] = None, data_format: Optional[str] = None, limit: Optional[int] = None,
             include_base: bool = True, json_out: Optional[Path] = None, plot: Optional[Path] = None,
             overrides: Sequence[str] = (), console: Optional[Console] = None,
             teacher_forced: bool = False) -> list[ModelResult]:
    """Evaluate the base model (unless ``include_base`` is False) and every run; print, and write JSON / PNG.
    ``teacher_forced`` adds delft.evaluation.teacher_forced's metrics on the gold completions (table, JSON, a second PNG)."""
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
            r.vs_base = versus(results[0], r, cfg.eval.bootstrap)

    console.print(render_table(results, title, shows_harness_scores(data_cfg, cfg.eval)))
    for r in results[1:] if include_base else []:
        console.print(difference_line(r))
    if teacher_forced:
        print_teacher(results, include_base, cfg.eval.bootstrap, console)

    if json_out is not None:
        write_result(Path(json_out), json.dumps(to_json(results, problems, settings), indent=2), "--json")
        console.print(f"[green]wrote[/] {json_out}")
    if plot is not None:
        write_plot(results, Path(plot), title)
        console.print(f"[green]wrote[/] {plot}")
        if teacher_forced:
            from delft.evaluation.teacher_forced import teacher_plot_path, write_teacher_plot

            second = teacher_plot_path(Path(plot))
            write_teacher_plot([r.name for r in results], [r.teacher_metrics for r in results], second,
                               f"teacher-forced on the gold completions: {title}")
            console.print(f"[green]wrote[/] {second}")
    return results
