"""What a comparison's models score, and how it is shown: every model (the base model, each arm's run per seed)
on one eval set with paired differences from the base model and from the reference arm, the means over seeds, the
tables (terminal and tables.txt), the report's JSON section and its Markdown, and the checks on where results go.
``delft compare`` and ``delft study`` share them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console

from delft.errors import UserError
from delft.evaluation.contamination import counted, generated_exclusion, score_unseen, seen_lines
from delft.evaluation.metrics import (
    COLUMNS,
    EXACT_MATCH,
    HEADLINE,
    PAIRED,
    Metric,
    bootstrap_ci,
    differences,
    flags,
    place_order,
    summarize,
)
from delft.evaluation.model_scores import evaluate_models
from delft.evaluation.problems import BOOTSTRAP_SEED, describe_source, load_problems, settings_block
from delft.evaluation.report import predictions, render_table
from delft.evaluation.results import ModelResult
from delft.experiments.contenders import Contender, reference_name
from delft.numbers.answers import canonical
from delft.numbers.digits import place_name
from delft.outputs import check_output_dir, num, pct
from delft.recipe.schema import Recipe
from delft.rundir import RUN_INFO


@dataclass
class Column:
    """One evaluated model (or the mean over seeds of one recipe) in one eval set."""

    name: str
    recipe_name: Optional[str]
    seed: Optional[int]
    adapter: Optional[str]
    result: Any = None  # delft.evaluation.model_scores.ModelResult
    vs_base: Optional[dict] = None
    vs_reference: Optional[dict] = None
    contamination: Optional[dict] = None  # its training problems in the set (delft.evaluation.contamination)


def evaluate_set(key: str, data_cfg, recipe_cfg: Recipe, base: str, contenders: list[Contender],
                 seeds: list[int], runs: dict[tuple[str, int], Path], console: Console,
                 tables: Console, command: str = "delft compare", loaded: Optional[tuple] = None,
                 allow_seen: bool = False) -> tuple[dict, list]:
    """Every model on one eval set: tables, paired differences, each model's training problems in it
    (delft.evaluation.contamination); (the JSON section, what its plot shows). ``loaded`` is the set's (problems,
    skipped) when the caller loaded them already (study, before training: it refuses a mostly-seen set then);
    otherwise a generated set is drawn without the recipe's training problems and a mostly-seen one is refused
    unless ``allow_seen``."""
    checked = loaded is not None  # its caller refused it then if it was mostly training data
    if loaded is None:
        loaded = load_problems(data_cfg, console, generated_exclusion(data_cfg, [recipe_cfg.data], []))
    problems, skipped = loaded
    heading = f"{len(problems)} problems from {describe_source(data_cfg)}"
    columns = _columns(contenders, seeds, runs)
    seen = counted(problems, {col.name: col.adapter for col in columns}, f"the {key} set ({heading})",
                   f"{command}: the {key} set", allow_seen or checked)
    console.rule(f"[bold]{key}[/]: {heading}")
    start = time.perf_counter()
    results = evaluate_models([(col.name, col.adapter) for col in columns], base, problems, data_cfg, recipe_cfg,
                              console)
    seconds = time.perf_counter() - start
    for col, r in zip(columns, results):
        col.result = r
        col.contamination = score_unseen(seen[col.name], problems, r.scored)
    ref_name = reference_name(contenders)
    boot = recipe_cfg.eval.bootstrap
    _pair_up(columns, ref_name, boot)
    means = _seed_means(columns, contenders, seeds, ref_name, boot)
    _show_tables(key, heading, columns, means, seeds, ref_name, console, tables, command)
    for target in (console, tables):
        for line in seen_lines({col.name: col.contamination for col in columns}):
            target.print(line, highlight=False)
    section = _section(data_cfg, recipe_cfg, problems, skipped, columns, means, contenders, ref_name, seconds)
    return section, _plot_results(columns, means, seeds)


def _columns(contenders: Sequence[Contender], seeds: Sequence[int], runs: dict[tuple[str, int], Path]) -> list[Column]:
    """The base model, then every recipe's run per seed."""
    trained = [Column(f"{c.name}-seed{seed}", c.name, seed, str(runs[(c.name, seed)]))
               for seed in seeds for c in contenders]
    return [Column("base", None, None, None)] + trained


def _pair_up(columns: list[Column], ref_name: str, resamples: int) -> None:
    """Each run's paired differences from the base model and from the reference recipe's run of its seed."""
    base = flags(columns[0].result.scored)
    by = {(col.recipe_name, col.seed): col for col in columns[1:]}
    for col in columns[1:]:
        own = flags(col.result.scored)
        col.vs_base = differences(base, own, resamples)
        if col.recipe_name != ref_name:
            col.vs_reference = differences(flags(by[(ref_name, col.seed)].result.scored), own, resamples)


def _seed_means(columns: list[Column], contenders: Sequence[Contender], seeds: Sequence[int], ref_name: str,
                resamples: int) -> list[dict]:
    """Per recipe, its metrics and differences averaged over the training seeds ([] for one seed)."""
    if len(seeds) < 2:
        return []
    by = {(col.recipe_name, col.seed): col.result.scored for col in columns[1:]}
    base = flags(columns[0].result.scored)
    reference = _averaged([by[(ref_name, s)] for s in seeds])
    means = []
    for c in contenders:
        lists = [by[(c.name, s)] for s in seeds]
        own = _averaged(lists)
        means.append({"name": c.name, "loss": c.recipe.loss.model_dump(mode="json"), "seeds": list(seeds),
                      "metrics": mean_over_seeds(lists, resamples, BOOTSTRAP_SEED),
                      "vs_base": differences(base, own, resamples),
                      "vs_reference": None if c.name == ref_name else differences(reference, own, resamples)})
    return means


def mean_over_seeds(scored_lists: list[list], resamples: int, seed: int) -> dict:
    """Metrics of one recipe averaged over its seeds (same problems for each).

    Rates and MAE are those of the pooled predictions (equal to the mean of the seeds' rates); the 95 % CIs
    are a bootstrap over problems of each problem's seed-averaged score, so problems are not counted twice.
    ``n`` and the per-place ``n`` count problems; ``n_with_number`` and ``rules`` count all seeds' predictions.
    """
    n = len(scored_lists[0])
    pooled = summarize([s for lst in scored_lists for s in lst], resamples, seed)
    for metric, per_problem in zip(PAIRED, _averaged(scored_lists)):
        ci = bootstrap_ci(per_problem, resamples, seed)
        pooled[f"{metric.key}_ci"] = list(ci) if ci else None
    pooled["n"] = n
    pooled["seeds"] = len(scored_lists)
    pooled["predictions"] = n * len(scored_lists)
    for place in pooled["per_place"].values():
        place["n"] //= len(scored_lists)
    per_seed = [summarize(lst, 0, seed) for lst in scored_lists]
    pooled["per_seed"] = {h.key: [m[h.key] for m in per_seed] for h in HEADLINE}
    return pooled


def _averaged(scored_lists: list[list]) -> tuple[list[float], ...]:
    """Per problem, each PAIRED metric (exact, tolerance match) averaged over seeds (the seed mean's
    paired-bootstrap input)."""
    per_seed = [flags(lst) for lst in scored_lists]
    return tuple([sum(f[k][i] for f in per_seed) / len(per_seed) for i in range(len(scored_lists[0]))]
                 for k in range(len(PAIRED)))


def _show_tables(key: str, heading: str, columns: list[Column], means: list[dict], seeds: Sequence[int],
                 ref_name: str, console: Console, tables: Console, command: str = "delft compare") -> None:
    """One table per seed (base and each recipe), then the seed means, to the terminal and tables.txt."""
    def show(title: str, results: list, notes: list[str]) -> None:
        for target in (console, tables):
            target.print(render_table(results, title))
            for line in notes:
                target.print(line, highlight=False)
            target.print()

    for seed in seeds:
        cols = [columns[0]] + [c for c in columns[1:] if c.seed == seed]
        results = [ModelResult(c.recipe_name or "base", c.adapter, metrics=c.result.metrics) for c in cols]
        notes = [_diff_line(f"{c.recipe_name} vs {ref_name} (seed {seed})", c.vs_reference)
                 for c in cols[1:] if c.vs_reference]
        show(f"{command}, {key}: {heading}, training seed {seed}", results, notes)
    if means:
        results = [ModelResult("base", None, metrics=columns[0].result.metrics)] + [
            ModelResult(f"{m['name']} (mean)", None, metrics=m["metrics"]) for m in means]
        notes = [_diff_line(f"{m['name']} vs {ref_name} (mean of seeds)", m["vs_reference"])
                 for m in means if m["vs_reference"]]
        show(f"{command}, {key}: mean over training seeds {', '.join(map(str, seeds))} (CI: bootstrap over "
             "problems of the seed-averaged score)", results, notes)


def _diff_line(label: str, d: dict) -> str:
    parts = []
    for m in PAIRED:
        x = d[m.key]
        ci = x["ci"]
        span = f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
        parts.append(f"{m.short} {100 * x['difference']:+.1f}{span}")
    return f"{label}: " + ", ".join(parts) + " points (paired bootstrap, 95 % CI)"


def _plot_results(columns: list[Column], means: list[dict], seeds: Sequence[int]) -> list:
    """What places_<set>.png shows: base and the seed means, or base and each recipe's first-seed run."""
    base = ModelResult("base", None, metrics=columns[0].result.metrics)
    if means:
        return [base] + [ModelResult(m["name"], None, metrics=m["metrics"]) for m in means]
    first_seed = [c for c in columns[1:] if c.seed == seeds[0]]
    return [base] + [ModelResult(c.recipe_name, None, metrics=c.result.metrics) for c in first_seed]


def _section(data_cfg, recipe_cfg: Recipe, problems: list, skipped: int, columns: list[Column], means: list[dict],
             contenders: Sequence[Contender], ref_name: str, seconds: float) -> dict:
    """The JSON section of one eval set: settings, problems, every model's predictions, the seed means."""
    base = columns[0].result
    losses = {c.name: c.recipe.loss.model_dump(mode="json") for c in contenders}
    section = {
        "settings": {"source": data_cfg.source, **settings_block(data_cfg, recipe_cfg, len(problems), skipped),
                     "template": base.template, "stop_strings": base.stop_strings,
                     "prompt_example": base.prompts[0] if base.prompts else None, "reference": ref_name,
                     "seconds": round(seconds, 1)},
        "problems": [{"index": p.index, "question": p.example.prompt if isinstance(p.example.prompt, str)
                      else p.example.prompt[-1]["content"], "gold": canonical(p.gold)} for p in problems],
        "models": [],
        "means": means,
    }
    for col in columns:
        r = col.result
        preds = predictions(r, problems, prompts=False)  # the same prompts for every model: see prompt_example
        section["models"].append({
            "name": col.name, "recipe": col.recipe_name, "seed": col.seed, "adapter": col.adapter,
            "loss": losses.get(col.recipe_name), "metrics": r.metrics, "vs_base": col.vs_base,
            "vs_reference": col.vs_reference, "contamination": col.contamination, "predictions": preds})
    return section


def markdown_summary(report: dict) -> str:
    """The report as Markdown tables (rows: models; seed means after their seeds), for docs and reviews."""
    lines = [f"Generated by `{report['command']}` (delft {report['delft_version']}).", ""]
    for key, sec in report["evals"].items():
        lines += markdown_set(key, sec, report["settings"]["reference"])
    return "\n".join(lines)


def markdown_set(key: str, sec: dict, ref: str) -> list[str]:
    """One greedy eval set's Markdown: the metrics table (seeds, then their mean) and per-place accuracy."""
    st = sec["settings"]
    rows = []  # (label, metrics, vs_reference)
    by_recipe: dict[str, list] = {}
    for m in sec["models"]:
        by_recipe.setdefault(m["recipe"] or "base", []).append(m)
    means = {m["name"]: m for m in sec["means"]}
    for recipe, models in by_recipe.items():
        for m in models:
            label = m["name"] if m["seed"] is None else f"{recipe} (seed {m['seed']})"
            rows.append((label, m["metrics"], m["vs_reference"]))
        if recipe in means:
            rows.append((f"**{recipe} (mean)**", means[recipe]["metrics"], means[recipe]["vs_reference"]))
    src = st["source"] if st["source"] != "synthetic" else f"synthetic, seed {st['data']['synthetic']['seed']}"
    # the difference from the reference follows the columns with intervals, before the plain numbers
    split = next((i for i, c in enumerate(COLUMNS) if not c.interval), len(COLUMNS))
    heads = [_head(c) for c in COLUMNS]
    heads.insert(split, f"{EXACT_MATCH.short} vs {ref}, points [95 % CI]")
    lines = [f"### {key}: {st['n']} problems ({src}), greedy, max_new_tokens {st['max_new_tokens']}", "",
             "| model | " + " | ".join(heads) + " |", "|" + "---|" * (len(heads) + 1)]
    for label, m, vs in rows:
        cells = [_cell(c, m) for c in COLUMNS]
        cells.insert(split, _diff(vs))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    places = place_order(p["place"] for _, m, _ in rows for p in m["per_place"].values())
    names = [place_name(p) for p in places]
    counts = [max(m["per_place"].get(n, {}).get("n", 0) for _, m, _ in rows) for n in names]
    lines += ["", "Per-place digit accuracy, % (n = problems whose gold answer has that place):", "",
              "| model | " + " | ".join(f"{n} (n={c})" for n, c in zip(names, counts)) + " |",
              "|---|" + "---|" * len(names)]
    for label, m, _ in rows:
        lines.append(f"| {label} | " + " | ".join(pct(m["per_place"].get(n, {}).get("accuracy"), unit='')
                                                 for n in names) + " |")
    lines.append("")
    return lines


def _head(c: Metric) -> str:
    """``c``'s Markdown column heading: its name, its unit, its interval."""
    return c.name + (" %" if c.rate else "") + (" [95 % CI]" if c.interval else "")


def _cell(c: Metric, m: dict) -> str:
    """``c``'s Markdown cell from one model's metrics ``m``."""
    if c.interval:
        return _ci(m, c.key)
    return pct(m.get(c.key), unit='') if c.rate else num(m.get(c.key), c.fmt)


def _ci(m: dict, key: str) -> str:
    ci = m.get(f"{key}_ci")
    return pct(m.get(key), unit='') + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def _diff(d: Optional[dict]) -> str:
    if not d:
        return ""
    x = d[EXACT_MATCH.key]
    ci = x["ci"]
    return f"{100 * x['difference']:+.1f}" + (f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else "")


def json_ready(obj):
    """JSON-safe copy (NaN/inf -> None)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def earlier_results(out: Path, fixed: Sequence[str]) -> list[str]:
    """The result files a compare (or study) wrote into ``out`` before: the ``fixed`` names (its report first)
    and the plots its report lists. Only these are replaced (with --force); other files in ``out`` are kept."""
    out = Path(out)
    found = [n for n in fixed if (out / n).is_file()]
    try:
        listed = json.loads((out / fixed[0]).read_text(encoding="utf-8")).get("plots") or {}
        plots = [Path(str(p)).name for p in listed.values()]
    except (OSError, ValueError, AttributeError):  # no report, or not one of ours
        plots = []
    return found + [n for n in dict.fromkeys(plots) if n not in found and (out / n).is_file()]


def check_results_out(out: Path, fixed: Sequence[str], plots: Sequence[str], runs: Sequence[Path], force: bool,
                      flag: str) -> None:
    """Before any training: ``out`` is no run directory nor inside one (nor one of ``runs``, still to be trained),
    and holds no earlier results (``earlier_results``, or a file named like a plot to be written) unless ``force``."""
    check_output_dir(out, flag)
    where = Path(out).resolve()
    inside = next((d for d in (where, *where.parents) if (d / RUN_INFO).is_file()), None)
    if inside is None:
        inside = next((r for r in runs if Path(r).resolve() in (where, *where.parents)), None)
    if inside is not None:
        raise UserError(f"{out} is inside the run directory {inside}: results written there would replace or mix "
                        "with the run's own files (loss_curve.png, metrics.jsonl, ...)", flag,
                        "Choose an out of its own, e.g. results/my-comparison.")
    clash = list(dict.fromkeys(earlier_results(out, fixed) + [n for n in plots if (Path(out) / n).exists()]))
    if clash and not force:
        more = f" and {len(clash) - 6} more" if len(clash) > 6 else ""
        raise UserError(f"{out} already holds results ({', '.join(clash[:6])}{more})", flag,
                        "Choose another out, or pass --force to replace them: the earlier result files go as a set "
                        "(nothing else in the directory is touched).")
