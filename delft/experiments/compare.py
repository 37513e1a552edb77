"""``delft compare``: the same training run once per loss, then every adapter evaluated side by side.

Recipes given on the command line must resolve (after ``base:`` and ``--set``) to the same settings except
their ``loss`` section (and ``output.dir``, which compare replaces). A recipe that another given recipe
extends (``recipes/compare/base.yaml``) is their shared base, not a run of its own, and is skipped.

For every recipe and ``--seed`` N the run lives in ``<parent of output.dir>/<recipe name>-seed<N>``
(``runs/compare/del-seed1``): finished runs are reused and interrupted ones resume from their last checkpoint,
both only after checking they were trained with this recipe (``check_adoptable``); missing ones are trained. Then
the base model and every adapter answer (a) the recipe's held-out synthetic set and (b) with ``--transfer FILE``,
a slice of a transfer set such as SVAMP (none unless given), with the machinery of ``delft eval``; tables go to
the terminal and ``tables.txt`` (and as Markdown to ``summary.md``), every metric, interval and prediction to
``compare.json``, per-place digit accuracy to ``places_<set>.png``. Earlier results in ``--out`` are refused
before any training unless ``--force``, which replaces them as a set (``check_results_out``).
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console

from delft import __version__, signals
from delft.errors import UserError
from delft.outputs import check_output_dir, num, pct, result_set, tables_console, write_result
from delft.recipe.schema import Recipe
from delft.recipe.keys import flat_keys, recipe_differences
from delft.recipe.files import load_recipe, recipe_chain
from delft.rundir import (
    METRICS,
    RECIPE,
    RUN_INFO,
    has_files,
    is_finished_run,
    is_run_dir,
    latest_checkpoint,
    read_info,
)
from delft.training.resume import BOOKKEEPING_KEYS

REPORT, TABLES, SUMMARY = "compare.json", "tables.txt", "summary.md"  # what compare writes into --out


DEFAULT_TRANSFER_FORMAT = "svamp"


DEFAULT_TRANSFER_LIMIT = 100


DEFAULT_TRANSFER_MAX_NEW_TOKENS = 32


REFERENCE_LOSS = "ce"  # differences are reported against the plain-CE run when there is one


FREE_KEYS = ("output.dir",)  # keys that may differ between compared recipes (compare sets them per run)


@dataclass
class Contender:
    """One compared recipe: its file, name (the file's stem) and resolved settings (before the seed)."""

    name: str
    path: Path
    recipe: Recipe

    def for_seed(self, seed: int) -> Recipe:
        cfg = self.recipe.model_copy(deep=True)
        cfg.train.seed = seed
        cfg.output.dir = str(run_dir_for(self.recipe, self.name, seed))
        return cfg


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


ARM_SECTIONS = ("loss", "grpo")  # what compared recipes may differ in: the loss, and a GRPO stage's reward and aux


def _comparable(recipe: Recipe) -> dict[str, Any]:
    """Every resolved key except the arm sections (loss, grpo) and the free keys."""
    return {k: v for k, v in flat_keys(recipe.to_dict()).items()
            if k.split(".")[0] not in ARM_SECTIONS and k not in FREE_KEYS}


def check_seeds(seeds: Sequence[int], where: str) -> list[int]:
    """The training seeds, each once ([0] when none): a repeated seed would train and count one run twice."""
    seeds = list(seeds) or [0]
    twice = [s for i, s in enumerate(seeds) if s in seeds[:i]]
    if twice:
        raise UserError(f"seed {twice[0]} is given twice ({', '.join(map(str, seeds))}): it would count one run as "
                        "two seeds", where, "Give each training seed once, e.g. 0, 1, 2.")
    return seeds


def run_dir_for(recipe: Recipe, name: str, seed: int) -> Path:
    return Path(recipe.output.dir).parent / f"{name}-seed{seed}"


# How compare and study (which shares this code) say where recipes are given, and how to give seeds.
_RECIPE_HINTS = {
    "delft compare": {"missing": "Check the path.", "seeds": "use --seed", "more": "(e.g. recipes/compare/*.yaml)"},
    "delft study": {"missing": "Check the path: a study file's recipes are relative to the study file.",
                    "seeds": "give it several seeds (seeds: [0, 1, 2])", "more": "(under recipes: in the study file)"},
}


def _unique_paths(paths: Sequence[Path], command: str, where: str) -> list[Path]:
    hints = _RECIPE_HINTS[command]
    if not paths:
        raise UserError("no recipes given", where, f"Give two or more recipes {hints['more']}.")
    unique: list[Path] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise UserError(f"recipe file {p} does not exist", where, hints["missing"])
        twin = next((q for q in unique if p.resolve() == q.resolve()), None)
        if twin is not None:
            raise UserError(f"{p} is given twice ({twin} is the same file)", where,
                            f"Give each recipe once; to train one recipe several times, {hints['seeds']}.")
        unique.append(p)
    return unique


def resolve_contenders(paths: Sequence[Path], overrides: Sequence[str], console: Console,
                       command: str = "delft compare", where: Optional[str] = None) -> list[Contender]:
    """Load the recipes, drop shared bases, and refuse any that differ in more than their loss. ``command``
    (delft compare or delft study) words the refusals, ``where`` (default: the command) places them."""
    where = where or command
    unique = _unique_paths(paths, command, where)
    bases = {b.resolve() for p in unique for b in recipe_chain(p)[1:]}
    contenders = []
    for p in unique:
        if p.resolve() in bases and len(unique) > 1:
            console.print(f"[dim]{p}: the shared base of the other recipes, not a run of its own[/]")
            continue
        contenders.append(Contender(p.stem, p, load_recipe(p, list(overrides))))
    if len(contenders) < 2:
        raise UserError(f"{command.split()[-1]} needs at least two recipes to compare, got {len(contenders)} "
                        f"({', '.join(str(c.path) for c in contenders)}; a recipe the others extend is their "
                        "shared base, not a run)", where, "Give two or more recipes that differ in their loss "
                        f"{_RECIPE_HINTS[command]['more']}; to train one recipe, use delft train.")
    names = [c.name for c in contenders]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"recipes share the name {', '.join(dup)} (their runs would share a directory)",
                        where, "Give each compared recipe a distinct file name.")
    first = contenders[0]
    ref = _comparable(first.recipe)
    problems = []
    for c in contenders[1:]:
        other = _comparable(c.recipe)
        for key in sorted(set(ref) | set(other)):
            if ref.get(key) != other.get(key):
                problems.append(f"{key} ({first.path.name}: {ref.get(key)!r}, {c.path.name}: {other.get(key)!r})")
    if problems:
        raise UserError("the recipes differ in more than their loss (and grpo) sections: " + "; ".join(problems),
                        where, "Move the shared settings into one base recipe (base: base.yaml) and "
                        "let each recipe set only loss: (and output.dir).")
    for i, a in enumerate(contenders):
        for b in contenders[i + 1:]:
            if a.recipe.loss == b.recipe.loss and (a.recipe.train.stage != "grpo" or a.recipe.grpo == b.recipe.grpo):
                raise UserError(f"{a.path} and {b.path} resolve to the same loss ({a.recipe.loss.type}, weight "
                                f"{a.recipe.loss.weight:g}): they would train the same run twice",
                                where, "Drop one of them.")
    return contenders


# What an existing run directory may differ in from the run compare would train there: the bookkeeping keys (the
# same adapter; delft.training.resume) and output.dir (it is this directory whatever the spelling).
ADOPT_FREE_KEYS = ("output.dir", *BOOKKEEPING_KEYS)


def check_adoptable(run_dir: Path, cfg: Recipe, what: str, where: str = "delft compare") -> None:
    """Use a run directory compare (or study) finds at a run's place only when it was trained with this recipe:
    a finished run is not reused, and an interrupted `delft train` not taken over (resumed to this recipe's steps,
    marked finished, its checkpoints deleted), when the saved recipe differs in more than ADOPT_FREE_KEYS."""
    saved_path = run_dir / RECIPE
    if not saved_path.is_file():
        return
    saved = load_recipe(saved_path)
    diff = sorted(recipe_differences(saved, cfg, ignore=ADOPT_FREE_KEYS))
    if diff:
        old, new = flat_keys(saved.to_dict()), flat_keys(cfg.to_dict())
        shown = "; ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in diff[:6])
        raise UserError(f"{run_dir} holds {what} of a different recipe ({shown}{'; ...' if len(diff) > 6 else ''})",
                        where, f"Move {run_dir} away (it is kept as it is) to train this "
                        f"recipe there, or restore the recipe it was trained with (its {RECIPE}).")


def _last_rows(run_dir: Path) -> dict:
    """The final training and validation rows of metrics.jsonl (for the JSON report)."""
    path = run_dir / METRICS
    out: dict = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:  # a line cut short or damaged: the report keeps the last whole rows
                continue
            if isinstance(row, dict):
                out["validation" if "val_loss" in row else "train"] = row
    return out


def ensure_trained(cfg: Recipe, console: Console, command: str) -> dict:
    """Reuse a finished run of this recipe, resume an interrupted one, or train it. Returns what happened."""
    from delft.models.loading import free_memory
    from delft.training.trainer import run_training

    run_dir = Path(cfg.output.dir)
    where = " ".join(command.split()[:2])  # delft compare, or delft study
    info = read_info(run_dir) if run_dir.is_dir() else {}
    if is_finished_run(run_dir):
        check_adoptable(run_dir, cfg, "a finished run", where)
        console.print(f"[dim]{run_dir}: finished run, reused[/]")
        return {"status": "reused", "steps": info.get("step"), **_last_rows(run_dir)}
    force = False
    status = "trained"
    if has_files(run_dir):
        if latest_checkpoint(run_dir) is not None:
            check_adoptable(run_dir, cfg, "an interrupted run", where)
            status = "resumed"
        elif is_run_dir(run_dir):
            check_adoptable(run_dir, cfg, "a run stopped before its first checkpoint", where)
            console.print(f"[yellow]{run_dir}: stopped before its first checkpoint; starting it again[/]")
            force = True
        else:
            raise UserError(f"{run_dir} exists and is not a delft run", where,
                            f"Move it away ({where.split()[-1]} keeps its runs beside the recipes' output.dir).")
    g = cfg.grpo
    arm = cfg.loss.type if cfg.train.stage != "grpo" else (
        f"GRPO, {g.reward} reward" + (f", aux mu {g.aux_mu:g} with {cfg.loss.type}" if g.aux_mu else ""))
    console.rule(f"[bold]{run_dir.name}[/]: training ({arm}, seed {cfg.train.seed})")
    start = time.perf_counter()
    run_training(cfg, resume=None, force=force, console=console, resume_command=command)
    seconds = time.perf_counter() - start
    free_memory()
    steps = read_info(run_dir).get("step")
    return {"status": status, "steps": steps, "seconds": round(seconds, 1), **_last_rows(run_dir)}


def mean_over_seeds(scored_lists: list[list], resamples: int, seed: int) -> dict:
    """Metrics of one recipe averaged over its seeds (same problems for each).

    Rates and MAE are those of the pooled predictions (equal to the mean of the seeds' rates); the 95 % CIs
    are a bootstrap over problems of each problem's seed-averaged score, so problems are not counted twice.
    ``n`` and the per-place ``n`` count problems; ``n_with_number`` and ``rules`` count all seeds' predictions.
    """
    from delft.evaluation.metrics import bootstrap_ci, summarize

    n = len(scored_lists[0])
    pooled = summarize([s for lst in scored_lists for s in lst], resamples, seed)
    for key, per_problem in zip(("exact_match", "tolerance_match"), _averaged(scored_lists)):
        ci = bootstrap_ci(per_problem, resamples, seed)
        pooled[f"{key}_ci"] = list(ci) if ci else None
    pooled["n"] = n
    pooled["seeds"] = len(scored_lists)
    pooled["predictions"] = n * len(scored_lists)
    for place in pooled["per_place"].values():
        place["n"] //= len(scored_lists)
    per_seed = [summarize(lst, 0, seed) for lst in scored_lists]
    pooled["per_seed"] = {k: [m[k] for m in per_seed] for k in ("exact_match", "tolerance_match",
                                                                 "digit_accuracy", "mae", "no_number_rate")}
    return pooled


def _averaged(scored_lists: list[list]) -> tuple[list[float], list[float]]:
    """Per problem, exact and tolerance match averaged over seeds (the seed mean's paired-bootstrap input)."""
    from delft.evaluation.metrics import flags

    per_seed = [flags(lst) for lst in scored_lists]
    return tuple([sum(f[k][i] for f in per_seed) / len(per_seed) for i in range(len(scored_lists[0]))]
                 for k in (0, 1))


def _diff_line(label: str, d: dict) -> str:
    parts = []
    for key, what in (("exact_match", "exact"), ("tolerance_match", "tolerance")):
        x = d[key]
        ci = x["ci"]
        span = f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
        parts.append(f"{what} {100 * x['difference']:+.1f}{span}")
    return f"{label}: " + ", ".join(parts) + " points (paired bootstrap, 95 % CI)"


def reference_name(contenders: Sequence[Contender]) -> str:
    """The recipe differences are reported against: the plain-CE one when there is one, else the first."""
    return next((c.name for c in contenders if c.recipe.loss.type == REFERENCE_LOSS), contenders[0].name)


def _columns(contenders: Sequence[Contender], seeds: Sequence[int], runs: dict[tuple[str, int], Path]) -> list[Column]:
    """The base model, then every recipe's run per seed."""
    trained = [Column(f"{c.name}-seed{seed}", c.name, seed, str(runs[(c.name, seed)])) for seed in seeds for c in contenders]
    return [Column("base", None, None, None)] + trained


def _pair_up(columns: list[Column], ref_name: str, resamples: int) -> None:
    """Each run's paired differences from the base model and from the reference recipe's run of its seed."""
    from delft.evaluation.metrics import differences, flags

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
    from delft.evaluation.metrics import differences, flags
    from delft.evaluation.problems import BOOTSTRAP_SEED

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


def _show_tables(key: str, heading: str, columns: list[Column], means: list[dict], seeds: Sequence[int],
                 ref_name: str, console: Console, tables: Console, command: str = "delft compare") -> None:
    """One table per seed (base and each recipe), then the seed means, to the terminal and tables.txt."""
    from delft.evaluation.report import render_table
    from delft.evaluation.results import ModelResult

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


def _plot_results(columns: list[Column], means: list[dict], seeds: Sequence[int]) -> list:
    """What places_<set>.png shows: base and the seed means, or base and each recipe's first-seed run."""
    from delft.evaluation.results import ModelResult

    base = ModelResult("base", None, metrics=columns[0].result.metrics)
    if means:
        return [base] + [ModelResult(m["name"], None, metrics=m["metrics"]) for m in means]
    first_seed = [c for c in columns[1:] if c.seed == seeds[0]]
    return [base] + [ModelResult(c.recipe_name, None, metrics=c.result.metrics) for c in first_seed]


def _section(data_cfg, recipe_cfg: Recipe, problems: list, skipped: int, columns: list[Column], means: list[dict],
             contenders: Sequence[Contender], ref_name: str, seconds: float) -> dict:
    """The JSON section of one eval set: settings, problems, every model's predictions, the seed means."""
    from delft.evaluation.problems import settings_block
    from delft.evaluation.report import predictions
    from delft.numbers.answers import canonical

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
            "vs_reference": col.vs_reference, "predictions": preds})
    return section


def evaluate_set(key: str, data_cfg, recipe_cfg: Recipe, base: str, contenders: list[Contender],
                 seeds: list[int], runs: dict[tuple[str, int], Path], console: Console,
                 tables: Console, command: str = "delft compare", loaded: Optional[tuple] = None) -> tuple[dict, list]:
    """Every model on one eval set: tables, paired differences; (the JSON section, what its plot shows).
    ``loaded`` is the set's (problems, skipped) when the caller loaded them already (study, before training)."""
    from delft.evaluation.problems import describe_source, load_problems
    from delft.evaluation.model_scores import evaluate_models

    problems, skipped = loaded if loaded is not None else load_problems(data_cfg, console)
    heading = f"{len(problems)} problems from {describe_source(data_cfg)}"
    columns = _columns(contenders, seeds, runs)
    console.rule(f"[bold]{key}[/]: {heading}")
    start = time.perf_counter()
    results = evaluate_models([(col.name, col.adapter) for col in columns], base, problems, data_cfg, recipe_cfg,
                              console)
    seconds = time.perf_counter() - start
    for col, r in zip(columns, results):
        col.result = r
    ref_name = reference_name(contenders)
    boot = recipe_cfg.eval.bootstrap
    _pair_up(columns, ref_name, boot)
    means = _seed_means(columns, contenders, seeds, ref_name, boot)
    _show_tables(key, heading, columns, means, seeds, ref_name, console, tables, command)
    section = _section(data_cfg, recipe_cfg, problems, skipped, columns, means, contenders, ref_name, seconds)
    return section, _plot_results(columns, means, seeds)


def transfer_data(cfg: Recipe, source: str, fmt: str, limit: int):
    """The transfer eval set as a DataConfig, rendered like the training data (template, system prompt)."""
    from pydantic import ValidationError

    from delft.recipe.schema import DataConfig

    fields = cfg.data.model_dump()
    fields.update(source=source, format=fmt, limit=limit, val_size=0)
    fields.pop("synthetic", None)
    try:
        return DataConfig.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise UserError(f"invalid transfer set: {problems}", "--transfer/--transfer-format",
                        "e.g. --transfer data/svamp.json --transfer-format svamp.") from None




def _ci(m: dict, key: str) -> str:
    ci = m.get(f"{key}_ci")
    return pct(m.get(key), unit='') + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")




def _diff(d: Optional[dict]) -> str:
    if not d:
        return ""
    x = d["exact_match"]
    ci = x["ci"]
    return f"{100 * x['difference']:+.1f}" + (f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else "")


def markdown_summary(report: dict) -> str:
    """The report as Markdown tables (rows: models; seed means after their seeds), for docs and reviews."""
    lines = [f"Generated by `{report['command']}` (delft {report['delft_version']}).", ""]
    for key, sec in report["evals"].items():
        lines += markdown_set(key, sec, report["settings"]["reference"])
    return "\n".join(lines)


def markdown_set(key: str, sec: dict, ref: str) -> list[str]:
    """One greedy eval set's Markdown: the metrics table (seeds, then their mean) and per-place accuracy."""
    from delft.evaluation.metrics import place_order
    from delft.numbers.digits import place_name

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
    lines = [f"### {key}: {st['n']} problems ({src}), greedy, max_new_tokens {st['max_new_tokens']}", "",
             (f"| model | exact match % [95 % CI] | tolerance match % [95 % CI] | exact vs {ref}, points "
              "[95 % CI] | digit accuracy % | MAE | log-MAE | no number % |"),
             "|---|---|---|---|---|---|---|---|"]
    for label, m, vs in rows:
        lines.append(f"| {label} | {_ci(m, 'exact_match')} | {_ci(m, 'tolerance_match')} | {_diff(vs)} | "
                     f"{pct(m['digit_accuracy'], unit='')} | {num(m['mae'])} | {num(m['log_mae'])} | "
                     f"{pct(m['no_number_rate'], unit='')} |")
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


def json_ready(obj):
    """JSON-safe copy (NaN/inf -> None)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def _command(recipe_paths: Sequence[Path], seeds: Sequence[int], out: Path, overrides: Sequence[str]) -> str:
    """The command line that reproduces this comparison (in the report, and to resume an interrupted run)."""
    return shlex.join(["delft", "compare", *map(str, recipe_paths), *[x for s in seeds for x in ("--seed", str(s))],
                       "--out", str(out), *[x for o in overrides for x in ("--set", o)]])


def train_all(contenders: Sequence[Contender], seeds: Sequence[int], console: Console,
              command: str) -> tuple[dict[tuple[str, int], Path], dict[str, dict]]:
    """Every (recipe, seed) run trained, resumed or reused, before any eval: (run directories, what happened)."""
    runs: dict[tuple[str, int], Path] = {}
    training: dict[str, dict] = {}
    for seed in seeds:
        for c in contenders:
            cfg = c.for_seed(seed)
            runs[(c.name, seed)] = Path(cfg.output.dir)
            training[f"{c.name}-seed{seed}"] = {"run": cfg.output.dir, **ensure_trained(cfg, console, command)}
            signals.check()  # a Ctrl-C lost in a finalizer after this run still stops before the next one
    return runs, training


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


def _transfer_key(transfer_cfg) -> str:
    key = Path(transfer_cfg.source).stem or "transfer"
    return "transfer" if key == "synthetic" else key


def _plot_path(out: Path, key: str) -> Path:
    return out / f"places_{key}.png"


def _write_plots(sets: dict[str, tuple[dict, list]], seeds: Sequence[int], out: Path) -> None:
    from delft.evaluation.report import write_plot

    what = "mean over seeds " + ", ".join(map(str, seeds)) if len(seeds) > 1 else f"seed {seeds[0]}"
    for key, (section, results) in sets.items():
        write_plot(results, _plot_path(out, key),
                   f"Per-place digit accuracy, {key} ({section['settings']['n']} problems; {what})", "--out")


def _write_results(out: Path, written: dict[str, str], sets: dict[str, tuple[dict, list]],
                   seeds: Sequence[int]) -> None:
    """The report files, then the plots, replacing compare's earlier results in ``out`` as a set."""
    with result_set(out, earlier_results(out, (REPORT, TABLES, SUMMARY)), "--out") as new:
        for name, text in written.items():  # the numbers first, then the pictures of them
            write_result(new / name, text, "--out")
        _write_plots(sets, seeds, new)


def _report_settings(cfg0: Recipe, contenders: Sequence[Contender], seeds: Sequence[int], base: str,
                     limit: Optional[int], transfer_cfg, transfer_max_new_tokens: int) -> dict:
    """What was compared: the recipes, their losses, seeds, and the settings they share."""
    common = cfg0.to_dict()
    common.pop("loss")
    common["output"] = {"dir": str(Path(cfg0.output.dir).parent) + "/<recipe>-seed<N>"}
    common["train"]["seed"] = "<seed>"
    return {
        "base_model": base,
        "recipes": {c.name: str(c.path) for c in contenders},
        "losses": {c.name: c.recipe.loss.model_dump(mode="json") for c in contenders},
        "seeds": list(seeds),
        "reference": reference_name(contenders),
        "recipe": common,
        "synthetic_limit": limit,
        "transfer": None if transfer_cfg is None else {
            "source": transfer_cfg.source, "format": transfer_cfg.format, "limit": transfer_cfg.limit,
            "max_new_tokens": transfer_max_new_tokens},
    }


def run_compare(recipe_paths: Sequence[Path], seeds: Sequence[int] = (0,), out: Path = Path("results/compare"),
                overrides: Sequence[str] = (), console: Optional[Console] = None,
                transfer: Optional[str] = None, transfer_format: str = DEFAULT_TRANSFER_FORMAT,
                transfer_limit: int = DEFAULT_TRANSFER_LIMIT,
                transfer_max_new_tokens: int = DEFAULT_TRANSFER_MAX_NEW_TOKENS, no_transfer: bool = False,
                force: bool = False) -> dict:
    """Train what is missing, evaluate base + every run on the synthetic set (and ``transfer``), write the report.

    The transfer set is evaluated only when ``transfer`` names a file (and ``no_transfer`` is False). Results
    already in ``out`` are refused before training unless ``force``, and then replaced as a set.
    Returns the JSON report (also written to ``out/compare.json``).
    """
    from delft.evaluation.runs import check_runs, resolve_settings

    console = console or Console()
    seeds = check_seeds(seeds, "--seed")
    if transfer_limit <= 0 or transfer_max_new_tokens <= 0:
        raise UserError("--transfer-limit and --transfer-max-new-tokens must be positive", "delft compare",
                        "e.g. --transfer-limit 100, or --no-transfer to skip the transfer set.")
    out = Path(out)
    check_output_dir(out, "--out")  # before hours of training, not after
    contenders = resolve_contenders(recipe_paths, overrides, console)
    cfg0 = contenders[0].for_seed(seeds[0])
    transfer_cfg = transfer_data(cfg0, transfer, transfer_format, transfer_limit) if transfer and not no_transfer \
        else None
    keys = ["synthetic"] + ([_transfer_key(transfer_cfg)] if transfer_cfg is not None else [])
    check_results_out(out, (REPORT, TABLES, SUMMARY), [_plot_path(out, k).name for k in keys],
                      [c.for_seed(s).output.dir for s in seeds for c in contenders], force, "--out")
    command = _command(recipe_paths, seeds, out, overrides)
    runs, training = train_all(contenders, seeds, console, command)

    # the settings delft eval would use with the first recipe
    _, base, synth_cfg, limit, _ = resolve_settings(contenders[0].path, [str(p) for p in runs.values()], None, None,
                                                    None, None, overrides, console)
    check_runs([str(p) for p in runs.values()], base)
    tables = tables_console()
    sets = {"synthetic": evaluate_set("synthetic", synth_cfg, cfg0, base, contenders, seeds, runs, console, tables)}
    if transfer_cfg is not None:
        tcfg = cfg0.model_copy(deep=True)
        tcfg.eval.max_new_tokens = transfer_max_new_tokens
        key = _transfer_key(transfer_cfg)
        sets[key] = evaluate_set(key, transfer_cfg, tcfg, base, contenders, seeds, runs, console, tables)

    report = json_ready({
        "delft_version": __version__,
        "command": command,
        "settings": _report_settings(cfg0, contenders, seeds, base, limit, transfer_cfg, transfer_max_new_tokens),
        "training": training,
        "evals": {key: section for key, (section, _) in sets.items()},
        "plots": {key: str(_plot_path(out, key)) for key in sets},
    })
    written = {REPORT: json.dumps(report, indent=1) + "\n", TABLES: tables.export_text(),
               SUMMARY: markdown_summary(report)}
    _write_results(out, written, sets, seeds)
    console.print(f"[green]wrote[/] {', '.join(str(out / name) for name in written)}, "
                  + ", ".join(report["plots"].values()))
    return report
