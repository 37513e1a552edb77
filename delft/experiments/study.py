"""``delft study``: a loss comparison written down in one file and run to the end by one command.

A study file (``recipes/study/*.study.yaml``) names the recipes (``delft compare``'s rule: they differ only in
their loss), the training seeds and the eval sets. ``delft study FILE`` trains every (recipe, seed) run that is
missing (finished runs are reused, interrupted ones resume: compare's machinery), then evaluates the base model
and every run on every set, either greedy (exact and tolerance match, per-place accuracy: ``delft eval``) or
teacher-forced on the gold completions (digit accuracy per place, digit CE, non-digit CE: ``delft eval
--teacher-forced``). Every difference is a paired bootstrap against the plain-CE recipe, per seed and pooled over
seeds (each problem's score averaged over the seeds first, so a problem is resampled once), reported with the
smallest difference the comparison could detect. ``out`` gets ``study.json`` (settings, training, every
prediction), ``summary.md``, ``tables.txt`` and one plot per set; earlier results there are refused before any
training unless ``--force``, which replaces them as a set (compare's ``check_results_out``). Every eval set is
read and checked (``load_sets``) before the first training step, so a set that cannot be scored is refused then.
``--report`` (``report_again``) writes the analysis, summary.md and tables.txt again from a stored study.json.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from delft import __version__
from delft.data.pipeline import load_examples
from delft.errors import UserError
from delft.evaluation.contamination import (
    count_seen,
    mix_line,
    problem_mix,
    refuse_mostly_seen,
    seen_record,
    training_prompts,
    with_commuted,
)
from delft.evaluation.model_scores import score_gold
from delft.evaluation.problems import BOOTSTRAP_SEED, load_problems, settings_block
from delft.evaluation.report import teacher_table, write_plot
from delft.evaluation.results import ModelResult
from delft.evaluation.runs import check_runs
from delft.evaluation.teacher_forced import (
    difference_line,
    mean_summaries,
    summarize_teacher,
    teacher_differences,
    write_teacher_plot,
)
from delft.experiments.arms import train_all
from delft.experiments.contenders import check_unsharded, reference_name, resolve_contenders
from delft.experiments.curves import check_curve, snapshot_override, study_curves
from delft.experiments.power import (
    PLAN_COLUMNS,
    Unpiloted,
    comparisons,
    control_flags,
    endpoint_floors,
    endpoint_lines,
    flag_lines,
    floored_in_pilot,
    plan_cells,
    plan_rows,
    read_pilot,
)
from delft.experiments.results import check_results_out, earlier_results, evaluate_set, json_ready
from delft.experiments.seed_level import FLOOR, analyse, analysis_renderables
from delft.experiments.seed_tests import ALPHA, POWER
from delft.experiments.study_file import EvalSet, StudyConfig, data_file, eval_data, load_study, split_overrides
from delft.experiments.summary import rewrite, study_summary
from delft.experiments.totals import own_results_as_pilot, planned_runs, show_runs, study_totals
from delft.experiments.transitions import check_measured, run_transitions
from delft.models.scratch import base_name
from delft.outputs import check_output_dir, result_set, tables_console, write_result
from delft.recipe.schema import GENERATED, DataConfig, Recipe

STUDY_JSON, SUMMARY, TABLES = "study.json", "summary.md", "tables.txt"
RESULT_FILES = (STUDY_JSON, SUMMARY, TABLES)  # what a study writes into out besides its plots (its report first)
def _contenders(study: StudyConfig, path: Path, overrides: Sequence[str], data_dir: Optional[Path], console: Console):
    """compare's contenders (same settings but the loss), their data files looked up in --data-dir."""

    if study.curve:
        overrides = [*overrides, snapshot_override(study.curve)]
    contenders = resolve_contenders([path.parent / r for r in study.recipe_files()], overrides, console, "delft study",
                                    f"{path}: recipes")
    for c in contenders:
        if c.recipe.data.source not in GENERATED and not Path(c.recipe.data.source).is_file():
            c.recipe.data.source = data_file(c.recipe.data.source, data_dir, f"{c.path}: data.source")
    return contenders


def _in_study(err: UserError, name: str, path: Path) -> UserError:
    """A data error placed at the study file's eval set (evals.NAME, evals.NAME.source, ...), not at the recipe
    keys (eval.data, data.source) the shared loader names."""
    key = f"evals.{name}"
    recipe_key = r"(?<![\w.])(?:eval\.)?data(?=\.\w|$)"
    where = re.sub(recipe_key, key, err.where or "data")
    return UserError(err.what, f"{path}: {where}", re.sub(recipe_key, key, err.fix) if err.fix else None)


def load_sets(sets: dict[str, DataConfig], path: Path, console: Console, train_data: DataConfig,
              allow_seen: bool = False) -> dict[str, tuple[list, int]]:
    """Every eval set's problems, read and checked (a file that parses, numeric answers, a hub dataset that can be
    reached) before the first training step: (problems, skipped) by set. A generated set is drawn without the
    problems of ``train_data`` (the recipes' data section) and their commuted forms; a set that is mostly those is
    refused unless ``allow_seen`` (delft.evaluation.contamination)."""
    seen = training_prompts(train_data)
    held_out = with_commuted(seen)
    loaded = {}
    for name, data_cfg in sets.items():
        try:
            loaded[name] = load_problems(data_cfg, console, held_out if data_cfg.format in GENERATED else frozenset())
        except UserError as e:
            raise _in_study(e, name, path) from None
        refuse_mostly_seen({"the recipes' runs": seen_record(loaded[name][0], seen)}, f"the eval set {name}",
                           f"{path}: evals.{name}", allow_seen)
    return loaded


def _greedy_set(key: str, data_cfg: DataConfig, spec: EvalSet, cfg0: Recipe, base: str, contenders, seeds,
                runs, console: Console, tables: Console, loaded: tuple) -> tuple[dict, list]:
    rcfg = cfg0.model_copy(deep=True)
    rcfg.eval.max_new_tokens = spec.max_new_tokens
    section, plotted = evaluate_set(key, data_cfg, rcfg, base, contenders, seeds, runs, console, tables,
                                    "delft study", loaded)
    section["settings"]["mode"] = "greedy"
    if data_cfg.format in GENERATED:  # leaving training problems out shifts the mix: say by how much
        section["settings"]["mix"] = set_mix(data_cfg, loaded[0])
        console.print(mix_line(key, section["settings"]["mix"]), highlight=False)
    return section, plotted


def set_mix(data_cfg: DataConfig, problems: list) -> dict:
    """A generated set's operations and digit counts against its generator's own draw of as many problems."""
    drawn = load_examples(data_cfg, "eval.data")
    return {"eval": problem_mix([p.example.prompt for p in problems]),
            "generator": problem_mix([e.prompt for e in drawn])}


def _teacher_line(name: str, ref: str, label: str, diff: dict) -> str:
    """``name``'s teacher-forced differences from ``ref`` (on one seed, or the seed means), with 95 % intervals."""
    parts = difference_line(name, diff).partition(": ")[2]  # its metrics; the line itself says "vs base"
    return f"{name} vs {ref} ({label}, teacher-forced, paired bootstrap): {parts}"


def _show_teacher(key: str, section: dict, seeds: Sequence[int], console: Console, tables: Console) -> None:
    """A teacher-forced set's tables, as the greedy sets': one per training seed (base and each recipe's run),
    then the seed means, each with the differences from the reference; on the screen and in tables.txt."""
    st, models = section["settings"], section["models"]
    ref, first = st["reference"], models[0]["metrics"]
    heading = f"delft study, {key}: {st['n']} gold completions, teacher-forced" + (
        f" ({first['truncated']} truncated at data.max_length)" if first["truncated"] else "")
    groups = [(f"training seed {s}", f"seed {s}", [(m["recipe"], m["recipe"], m) for m in models[1:]
                                                    if m["seed"] == s]) for s in seeds]
    if len(seeds) > 1:
        groups.append((f"mean over training seeds {', '.join(map(str, seeds))} (CI: bootstrap over problems of the "
                       "seed-averaged score)", "mean of seeds",
                       [(m["name"], f"{m['name']} (mean)", m) for m in section["means"]]))
    for what, label, cols in groups:
        results = [ModelResult("base", None, teacher_metrics=first)] + [
            ModelResult(column, None, teacher_metrics=m["metrics"]) for _, column, m in cols]
        notes = [_teacher_line(name, ref, label, m["vs_reference"]) for name, _, m in cols if m["vs_reference"]]
        for target in (console, tables):
            target.print(teacher_table(results, f"{heading}, {what}"))
            for line in notes:
                target.print(line, highlight=False)
            target.print()


def _teacher_set(key: str, data_cfg: DataConfig, cfg0: Recipe, base: str, contenders, seeds, runs,
                 console: Console, loaded: tuple) -> tuple[dict, list]:
    """Every model teacher-forced on the set's gold completions; differences per seed and pooled."""
    problems, skipped = loaded
    console.rule(f"[bold]{key}[/]: {len(problems)} gold completions, teacher-forced")
    start = time.perf_counter()
    columns = [("base", None, None)] + [(c.name, s, runs[(c.name, s)]) for s in seeds for c in contenders]
    scored = {}
    seen = {(name, seed): count_seen(problems, None if run is None else str(run)) for name, seed, run in columns}
    for name, seed, run in columns:
        scored[(name, seed)] = score_gold(base, None if run is None else str(run), problems, data_cfg, cfg0)
        k = seen[(name, seed)]["seen_in_training"]
        console.print(f"[dim]{name if seed is None else f'{name}-seed{seed}'}: scored ("
                      f"{'not counted' if k is None else k} of the {len(problems)} in its training data)[/]")
    ref, boot = reference_name(contenders), cfg0.eval.bootstrap
    models = []
    for name, seed, run in columns:
        tf = scored[(name, seed)]
        vs_ref = None if seed is None or name == ref else teacher_differences(scored[(ref, seed)], tf, boot,
                                                                              BOOTSTRAP_SEED)
        vs_base = None if seed is None else teacher_differences(scored[("base", None)], tf, boot, BOOTSTRAP_SEED)
        models.append({"name": "base" if seed is None else f"{name}-seed{seed}", "recipe": None if seed is None
                       else name, "seed": seed, "adapter": None if run is None else str(run),
                       "metrics": summarize_teacher(tf), "vs_base": vs_base, "vs_reference": vs_ref,
                       "contamination": seen[(name, seed)], "per_example": _per_example_record(tf)})
    means = []
    for c in contenders:
        own = [scored[(c.name, s)] for s in seeds]
        means.append({"name": c.name, "seeds": list(seeds),
                      "metrics": mean_summaries([summarize_teacher(tf) for tf in own]),
                      "vs_base": teacher_differences([scored[("base", None)]], own, boot, BOOTSTRAP_SEED),
                      "vs_reference": None if c.name == ref else teacher_differences(
                          [scored[(ref, s)] for s in seeds], own, boot, BOOTSTRAP_SEED)})
    section = {"settings": {"source": data_cfg.source, "mode": "teacher_forced",
                            **settings_block(data_cfg, cfg0, len(problems), skipped), "reference": ref,
                            "seconds": round(time.perf_counter() - start, 1)},
               "problems": [{"index": p.index, "gold": p.example.completion} for p in problems],
               "models": models, "means": means}
    return section, [("base", models[0]["metrics"])] + [(m["name"], m["metrics"]) for m in means]


def _per_example_record(tf) -> list[dict]:
    """Per gold completion: its digit positions scored right (ten-digit argmax) and its non-digit CE sum."""
    rows = [{"digits": 0, "digit_ok": 0, "text_tokens": 0, "text_ce_sum": 0.0} for _ in range(tf.n_examples)]
    for p in tf.positions:
        row = rows[p.example]
        if p.place is None:
            row["text_tokens"] += 1
            row["text_ce_sum"] = round(row["text_ce_sum"] + p.ce, 6)
        else:
            row["digits"] += 1
            row["digit_ok"] += int(bool(p.digit_ok))
    return rows


def _write_plots(out: Path, sections: dict[str, tuple[dict, list]], seeds: Sequence[int]) -> dict[str, str]:
    what = "mean over seeds " + ", ".join(map(str, seeds)) if len(seeds) > 1 else f"seed {seeds[0]}"
    paths = {}
    for key, (section, plotted) in sections.items():
        path = out / f"{key}.png"
        title = f"{key}: {section['settings']['n']} problems ({what})"
        if section["settings"]["mode"] == "teacher_forced":
            write_teacher_plot([n for n, _ in plotted], [m for _, m in plotted], path, f"teacher-forced, {title}")
        else:
            write_plot(plotted, path, f"Per-place digit accuracy, {title}", "out")
        paths[key] = str(path)
    return paths


def _write_results(out: Path, report: dict, tables: str, sections: dict[str, tuple[dict, list]],
                   seeds: Sequence[int], flag: str) -> None:
    """study.json, summary.md, tables.txt and the plots, replacing the study's earlier results in ``out`` as a
    set (an earlier study's plots of other sets never stay beside these)."""
    with result_set(out, earlier_results(out, RESULT_FILES), flag) as new:
        write_result(new / STUDY_JSON, json.dumps(report, indent=1) + "\n", flag)
        write_result(new / SUMMARY, study_summary(report), flag)
        write_result(new / TABLES, tables, flag)
        _write_plots(new, sections, seeds)


def _command(path: Path, data_dir: Optional[Path], overrides: Sequence[str], nproc: Optional[int] = None) -> str:
    return shlex.join(["delft", "study", str(path), *(["--data-dir", str(data_dir)] if data_dir else []),
                       *[x for o in overrides for x in ("--set", o)], *(["--nproc", str(nproc)] if nproc else [])])


def _evaluate_all(study: StudyConfig, sets: dict[str, DataConfig], loaded: dict, cfg0: Recipe, contenders, runs,
                  console: Console, tables: Console) -> dict[str, tuple[dict, list]]:
    """Every eval set in turn, its tables on the screen and in ``tables``: (JSON section, what it plots) by set."""
    base = base_name(cfg0)
    sections = {}
    for name, spec in study.evals.items():
        if spec.mode == "teacher_forced":
            sections[name] = _teacher_set(name, sets[name], cfg0, base, contenders, study.seeds, runs, console,
                                          loaded[name])
            _show_teacher(name, sections[name][0], study.seeds, console, tables)
        else:
            sections[name] = _greedy_set(name, sets[name], spec, cfg0, base, contenders, study.seeds, runs,
                                         console, tables, loaded[name])
    return sections


def _prepare(study: StudyConfig, path: Path, data_dir: Optional[Path], overrides: Sequence[str], console: Console,
             train_only: bool, force: bool, allow_seen: bool = False):
    """Every refusal before training: the out folder, the recipes, the controls, the curve, the eval sets.
    Returns (contenders, the first run's recipe, the sets, their problems (None with train_only))."""
    out = Path(study.out)
    check_output_dir(out, f"{path}: out")  # before hours of training, not after
    contenders = _contenders(study, path, overrides, data_dir, console)
    check_results_out(out, RESULT_FILES, [f"{key}.png" for key in study.evals],  # train_only writes no results
                      [c.for_seed(s).output.dir for s in study.seeds for c in contenders], force or train_only,
                      f"{path}: out")
    cfg0 = contenders[0].for_seed(study.seeds[0])
    _check_controls_and_curve(study, contenders, cfg0, path)
    sets = {name: eval_data(name, spec, cfg0, data_dir) for name, spec in study.evals.items()}
    loaded = None if train_only else load_sets(sets, path, console, cfg0.data, allow_seen)  # before training
    return contenders, cfg0, sets, loaded


def _check_controls_and_curve(study: StudyConfig, contenders, cfg0: Recipe, path: Path) -> None:
    ref = reference_name(contenders)
    if ref in study.controls() or ref in study.calibrators():
        raise UserError(f"the reference recipe {ref} is marked control or calibrator: either is compared with the "
                        "reference", f"{path}: recipes", "Mark the loss expected to move the metric, not the plain-CE "
                        "one.")
    if study.curve:
        if cfg0.train.max_steps is None:
            raise UserError("a curve needs the recipes' train.max_steps (its steps are counted against it)",
                            f"{path}: curve", "Set train.max_steps in the recipes.")
        check_curve(study.curve, cfg0.train.max_steps, f"{path}: curve")
    if study.learns_at is not None:
        check_measured({c.name: c.recipe for c in contenders}, f"{path}: learns_at")


def _curves(study: StudyConfig, sets: dict, loaded: dict, cfg0: Recipe, base: str, contenders, runs, sections,
            console: Console, tables: Console) -> dict:
    """Every greedy set at every curve step (the runs' snapshots), as curves (delft.experiments.curves)."""
    if not study.curve:
        return {}

    def evaluate(key: str, step: int, runs_at_step: dict) -> dict:
        return _greedy_set(f"{key} at step {step}", sets[key], study.evals[key], cfg0, base, contenders, study.seeds,
                           runs_at_step, console, tables, loaded[key])[0]

    greedy = [k for k, spec in study.evals.items() if spec.mode == "greedy"]
    return study_curves(study.curve, greedy, {k: sections[k][0] for k in greedy}, runs, cfg0.train.max_steps,
                        evaluate)


def _transitions(study: StudyConfig, cfg0: Recipe, contenders, runs: dict) -> Optional[dict]:
    """Each run's first step at learns_at (delft.experiments.transitions), or None when the file asks for none."""
    if study.learns_at is None:
        return None
    t = cfg0.train
    return run_transitions(runs, reference_name(contenders), study.learns_at, t.accuracy_steps, t.accuracy_examples)


def _report(study: StudyConfig, path: Path, command: str, base: str, cfg0: Recipe, contenders, training: dict,
            sections: dict, curves: dict, seconds: dict, transitions: Optional[dict] = None) -> dict:
    report = json_ready({
        "delft_version": __version__, "command": command, "study": str(path), "description": study.description,
        "settings": {"base_model": base, "recipes": {c.name: str(c.path) for c in contenders},
                     "losses": {c.name: c.recipe.loss.model_dump(mode="json") for c in contenders},
                     "controls": study.controls(), "calibrators": study.calibrators(), "decide": study.decide,
                     "margin": study.margin,
                     "margin_stated": "margin" in study.model_fields_set, "plan": _plan(study, path, contenders),
                     "curve": study.curve, "learns_at": study.learns_at,
                     "seeds": study.seeds, "recipe": cfg0.to_dict(),
                     "evals": {k: v.model_dump(mode="json") for k, v in study.evals.items()}},
        "training": training, "seconds": seconds,
        "evals": {key: section for key, (section, _) in sections.items()},
        "curves": curves, "transitions": transitions,
    })
    report["plots"] = {key: str(Path(study.out) / f"{key}.png") for key in sections}
    report.update(analyse(report, study.controls(), study.margin, "margin" in study.model_fields_set))
    return report


def _plan(study: StudyConfig, path: Path, contenders) -> Optional[dict]:
    """The detectable difference of every comparison the study will make, from its stated or piloted spread
    (delft.experiments.power), the endpoints' smallest p (those that cannot reach the level: descriptive, outside
    Holm's family) and the controls that did not move in the pilot; None when the file states no spread."""
    spec = study.plan
    if spec.seed_spread is None and spec.pilot is None:
        return None
    if spec.problem_variance is not None and spec.seed_spread is None:
        raise UserError("plan.problem_variance is stated without plan.seed_spread", f"{path}: plan",
                        "State the seed spread it goes with, or drop problem_variance (a pilot measures it).")
    ref = reference_name(contenders)
    names = [ref] + [c.name for c in contenders if c.name != ref]
    greedy = {key: s.limit for key, s in study.evals.items() if s.mode == "greedy"}
    pilot = read_pilot(path.parent / spec.pilot, f"{path}: plan.pilot") if spec.pilot else None
    planned = comparisons(names, greedy, bool(study.curve))
    endpoints = endpoint_floors(names, len(study.seeds), pilot) if study.learns_at is not None else []
    calibrators = study.calibrators()
    family = len([r for r in planned if r["recipe"] not in calibrators]) + sum(
        not e["descriptive"] and e["recipe"] not in calibrators for e in endpoints)
    floored = floored_in_pilot(pilot, planned) if spec.seed_spread is None else []
    try:
        rows = plan_rows([r for r in planned if (r["set"], r["recipe"]) not in floored], len(study.seeds),
                         study.margin, spec.seed_spread, pilot, family, study.decide, spec.problem_variance,
                         calibrators)
    except Unpiloted as e:
        missing = ", ".join(f"{r} on {s}" for s, r in e.args[0])
        raise UserError(f"the pilot {spec.pilot} did not run {missing}: a pilot must run every arm it plans for "
                        "(another arm's spread may be far smaller)", f"{path}: plan.pilot",
                        "Pilot every arm (2 or more seeds on the same set), or state plan.seed_spread for the arms "
                        "the pilot lacks (with both, the pilot's bound covers the arms it ran).") from None
    except ValueError:
        raise UserError(f"the pilot {spec.pilot} has no greedy set on which a recipe ran 2 or more seeds beside its "
                        "reference, so it shows no spread between seeds", f"{path}: plan.pilot",
                        "Give a pilot study with 2 or more seeds, or state plan.seed_spread.") from None
    return {"margin_points": study.margin, "decide": study.decide,
            "source": " and ".join(x for x in ("seed_spread" if spec.seed_spread is not None else "", spec.pilot or "")
                                   if x),
            "rows": rows, "family": family, "endpoints": endpoints,
            "floored": [{"set": s, "recipe": r} for s, r in floored],
            "descriptive": [{"recipe": e["recipe"], "metric": e["metric"]} for e in endpoints if e["descriptive"]],
            "flags": control_flags(pilot, study.controls(), calibrators)}


def plan_study(path: Path, data_dir: Optional[Path] = None, overrides: Sequence[str] = (),
               console: Optional[Console] = None) -> dict:
    """``delft study FILE --plan``: what each comparison can detect with the file's seeds and problems, before any
    run; a warning where that is larger than the margin."""
    console = console or Console()
    path = Path(path)
    own, overrides = split_overrides(overrides)
    study = load_study(path, own)
    contenders = _contenders(study, path, overrides, data_dir, console)
    runs = planned_runs(contenders, study.seeds)
    show_runs(runs, console, f"delft study --plan: {len(contenders)} recipes x {len(study.seeds)} seed(s)")
    console.print(study_totals(study, contenders, runs), highlight=False)
    own_results_as_pilot(study, console)
    plan = _plan(study, path, contenders)
    if plan is None:
        raise UserError("the study file states no spread between seeds, so there is nothing to compute power from",
                        f"{path}: plan", "State plan.seed_spread (points: how much the effect varies from seed to "
                        "seed) or plan.pilot (an earlier study.json with 2 or more seeds), or run the study once "
                        f"(its {Path(study.out) / STUDY_JSON} then serves as the pilot).")
    test = {"t": "t test over seeds", "two_way": "two-way interval over seeds and problems"}.get(
        study.decide, f"{study.decide} test over seeds")
    table = Table(title=f"delft study --plan: {len(study.seeds)} seeds, {100 * POWER:.0f} % power, {test} at Holm's "
                        f"strictest step over {plan['family']} comparisons (a calibrator: alone, at {ALPHA:g})")
    names = [r["set"] for r in plan["rows"]] + [r["recipe"] for r in plan["rows"]]
    for column in PLAN_COLUMNS:  # names whole: a cut one ('held_o...') reads as another set
        table.add_column(column, min_width=max(map(len, names)) if column in ("set", "recipe") else None)
    for r in plan["rows"]:
        table.add_row(*plan_cells(r, study.margin))
    console.print(table)
    for line in endpoint_lines(plan):
        console.print(line, highlight=False)
    for key in dict.fromkeys(f["set"] for f in plan["floored"]):
        recipes = [f["recipe"] for f in plan["floored"] if f["set"] == key]
        console.print(f"[yellow]note:[/] on {key} a side sat on the floor in the pilot ({', '.join(recipes)} against "
                      f"the reference, below {100 * FLOOR:g} % exact), so it shows no spread to plan with: those "
                      "comparisons are left out of the table, and the study reads a difference on a floor as not "
                      "readable", highlight=False)
    for line in flag_lines(plan):
        console.print(f"[yellow]warning:[/] {line[2:]}", highlight=False)
    wide = [r for r in plan["rows"] if r["above_margin"]]
    if wide:
        console.print(f"[yellow]warning:[/] {len(wide)} of {len(plan['rows'])} comparisons cannot detect a difference "
                      f"of the margin ({study.margin:g} points) with {100 * POWER:.0f} % power: add seeds or problems, "
                      "or read an 'inconclusive' there as what the design allowed.")
    return plan


def run_study(path: Path, data_dir: Optional[Path] = None, overrides: Sequence[str] = (),
              console: Optional[Console] = None, train_only: bool = False, force: bool = False,
              allow_seen: bool = False, nproc: Optional[int] = None) -> Optional[dict]:
    """Train what is missing (``nproc``: each run on that many processes), evaluate every set (and, with a curve,
    every snapshot), write study.json, summary.md and the plots into ``out`` (earlier results there only with
    ``force``, replaced as a set); a set that is mostly the runs' training data only with ``allow_seen``."""
    console = console or Console()
    path = Path(path)
    command = _command(path, data_dir, overrides, nproc)
    own, overrides = split_overrides(overrides)
    study = load_study(path, own)
    out = Path(study.out)
    contenders, cfg0, sets, loaded = _prepare(study, path, data_dir, overrides, console, train_only, force,
                                              allow_seen)
    check_unsharded(contenders, "delft study", "--nproc", nproc)
    console.print(study_totals(study, contenders, planned_runs(contenders, study.seeds)), highlight=False)
    start = time.perf_counter()
    runs, training = train_all(contenders, study.seeds, console, command, nproc)
    trained_s = time.perf_counter() - start
    if train_only:
        console.print(f"[green]trained[/] {len(runs)} runs; evaluate with: {command}")
        return None
    base = base_name(cfg0)
    check_runs([str(p) for p in runs.values()], base)
    tables = tables_console()
    sections = _evaluate_all(study, sets, loaded, cfg0, contenders, runs, console, tables)
    curves = _curves(study, sets, loaded, cfg0, base, contenders, runs, sections, console, tables)
    transitions = _transitions(study, cfg0, contenders, runs)
    seconds = {"training": round(trained_s, 1), "total": round(time.perf_counter() - start, 1)}
    report = _report(study, path, command, base, cfg0, contenders, training, sections, curves, seconds, transitions)
    analysis = analysis_renderables(report)
    for target in (console, tables):
        for item in analysis:
            target.print(item, highlight=False)
    _write_results(out, report, tables.export_text(), sections, study.seeds, f"{path}: out")
    console.print(f"[green]wrote[/] {out / STUDY_JSON}, {out / SUMMARY}, {out / TABLES} and "
                  f"{len(sections)} plots in {out}")
    return report


def report_again(path: Path, overrides: Sequence[str] = (), console: Optional[Console] = None) -> None:
    """``delft study FILE --report``: the study's analysis, summary.md and tables.txt written again from the
    study.json in its out with this code (delft.experiments.summary.rewrite); nothing trained or evaluated."""
    own, recipe_keys = split_overrides(overrides)
    if recipe_keys:
        raise UserError(f"--report trains and evaluates nothing, so recipe keys ({', '.join(recipe_keys)}) change "
                        "nothing in it", f"{path}: --set", "Drop them, or run the study without --report.")
    out = Path(load_study(Path(path), own).out)
    rewrite(out, str(path), f"{path}: out")
    (console or Console()).print(f"[green]wrote[/] {out / STUDY_JSON}'s analysis, {out / SUMMARY} and {out / TABLES} "
                                 f"again from {out / STUDY_JSON}")
