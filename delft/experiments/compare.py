"""``delft compare``: the same training run once per loss, then every adapter evaluated side by side.

Recipes given on the command line must resolve (after ``base:`` and ``--set``) to the same settings except
their ``loss`` section (and ``output.dir``, which compare replaces). A recipe that another given recipe
extends (``recipes/compare/base.yaml``) is their shared base, not a run of its own, and is skipped.

For every recipe and ``--seed`` N the run lives in ``<parent of output.dir>/<recipe name>-seed<N>``
(``runs/compare/del-seed1``): finished runs are reused and interrupted ones resume from their last checkpoint,
both only after checking they were trained with this recipe (``arms.check_adoptable``); missing ones are trained. Then
the base model and every adapter answer (a) the recipe's held-out synthetic set and (b) with ``--transfer FILE``,
a slice of a transfer set such as SVAMP (none unless given), with the machinery of ``delft eval``; tables go to
the terminal and ``tables.txt`` (and as Markdown to ``summary.md``), every metric, interval and prediction to
``compare.json``, per-place digit accuracy to ``places_<set>.png``. Earlier results in ``--out`` are refused
before any training unless ``--force``, which replaces them as a set (``results.check_results_out``).

This module is the command: the arms and their training are in delft.experiments.arms, the scores, tables and
report sections in delft.experiments.results (which ``delft study`` shares).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional, Sequence

from pydantic import ValidationError
from rich.console import Console

from delft import __version__
from delft.errors import UserError
from delft.evaluation.contamination import refuse_seen_before_training
from delft.evaluation.report import write_plot
from delft.evaluation.runs import check_runs, resolve_settings
from delft.experiments.arms import train_all
from delft.experiments.contenders import Contender, check_seeds, check_unsharded, reference_name, resolve_contenders
from delft.experiments.results import check_results_out, earlier_results, evaluate_set, json_ready, markdown_summary
from delft.experiments.totals import planned_runs, show_runs, totals_line
from delft.outputs import check_output_dir, result_set, tables_console, write_result
from delft.recipe.schema import DataConfig, Recipe

REPORT, TABLES, SUMMARY = "compare.json", "tables.txt", "summary.md"  # what compare writes into --out

DEFAULT_TRANSFER_FORMAT = "svamp"

DEFAULT_TRANSFER_LIMIT = 100

DEFAULT_TRANSFER_MAX_NEW_TOKENS = 32


def transfer_data(cfg: Recipe, source: str, fmt: str, limit: int):
    """The transfer eval set as a DataConfig, rendered like the training data (template, system prompt)."""
    fields = cfg.data.model_dump()
    fields.update(source=source, format=fmt, limit=limit, val_size=0)
    fields.pop("synthetic", None)
    try:
        return DataConfig.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise UserError(f"invalid transfer set: {problems}", "--transfer/--transfer-format",
                        "e.g. --transfer data/svamp.json --transfer-format svamp.") from None


def _command(recipe_paths: Sequence[Path], seeds: Sequence[int], out: Path, overrides: Sequence[str],
             nproc: Optional[int] = None) -> str:
    """The command line that reproduces this comparison (in the report, and to resume an interrupted run)."""
    return shlex.join(["delft", "compare", *map(str, recipe_paths), *[x for s in seeds for x in ("--seed", str(s))],
                       "--out", str(out), *[x for o in overrides for x in ("--set", o)],
                       *(["--nproc", str(nproc)] if nproc else [])])


def _transfer_key(transfer_cfg) -> str:
    key = Path(transfer_cfg.source).stem or "transfer"
    return "transfer" if key == "synthetic" else key


def _plot_path(out: Path, key: str) -> Path:
    return out / f"places_{key}.png"


def _write_plots(sets: dict[str, tuple[dict, list]], seeds: Sequence[int], out: Path) -> None:
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


def _evals_text(cfg0: Recipe, transfer_cfg) -> str:
    """The sets compare scores, in words (the synthetic set's size as the recipe's eval.limit gives it)."""
    limit = f" ({cfg0.eval.limit} problems)" if cfg0.eval.limit else ""
    transfer = "" if transfer_cfg is None else f" and {transfer_cfg.source} (its first {transfer_cfg.limit})"
    return f"the held-out synthetic set{limit}{transfer}"


def announce(contenders: Sequence[Contender], seeds: Sequence[int], cfg0: Recipe, transfer_cfg, console: Console,
             table: bool = False) -> list:
    """Say the job's size before any training (with ``table``, run by run: --plan); returns the planned runs."""
    planned = planned_runs(contenders, seeds)
    if table:
        show_runs(planned, console, f"delft compare --plan: {len(contenders)} recipes x {len(seeds)} seed(s)")
    console.print(f"[bold]delft compare[/]: {totals_line(planned, len(contenders), len(seeds))}; then the base model "
                  f"and {len(planned)} runs answer {_evals_text(cfg0, transfer_cfg)}", highlight=False)
    return planned


def plan_compare(recipe_paths: Sequence[Path], seeds: Sequence[int] = (0,), overrides: Sequence[str] = (),
                 console: Optional[Console] = None, transfer: Optional[str] = None,
                 transfer_format: str = DEFAULT_TRANSFER_FORMAT, transfer_limit: int = DEFAULT_TRANSFER_LIMIT,
                 no_transfer: bool = False) -> list:
    """``delft compare --plan``: the recipes resolved and checked as a comparison, every run's state and the steps
    left, the sets to score; nothing trained, evaluated or written. Returns the planned runs."""
    console = console or Console()
    seeds = check_seeds(seeds, "--seed")
    contenders = resolve_contenders(recipe_paths, overrides, console)
    cfg0 = contenders[0].for_seed(seeds[0])
    transfer_cfg = transfer_data(cfg0, transfer, transfer_format, transfer_limit) if transfer and not no_transfer \
        else None
    planned = announce(contenders, seeds, cfg0, transfer_cfg, console, table=True)
    console.print("[dim]--plan: nothing was trained, evaluated or written; the same command without --plan runs "
                  "it.[/]")
    return planned


def run_compare(recipe_paths: Sequence[Path], seeds: Sequence[int] = (0,), out: Path = Path("results/compare"),
                overrides: Sequence[str] = (), console: Optional[Console] = None,
                transfer: Optional[str] = None, transfer_format: str = DEFAULT_TRANSFER_FORMAT,
                transfer_limit: int = DEFAULT_TRANSFER_LIMIT,
                transfer_max_new_tokens: int = DEFAULT_TRANSFER_MAX_NEW_TOKENS, no_transfer: bool = False,
                force: bool = False, allow_seen: bool = False, nproc: Optional[int] = None) -> dict:
    """Train what is missing (``nproc``: each run on that many processes), evaluate base + every run on the
    synthetic set (and ``transfer``, when it names a file and not ``no_transfer``), write the report. Results
    already in ``out`` are refused before training unless ``force``, and then replaced as a set. A set that is
    mostly a run's training data is refused unless ``allow_seen``. Returns the report (also ``out/compare.json``)."""
    console = console or Console()
    seeds = check_seeds(seeds, "--seed")
    if transfer_limit <= 0 or transfer_max_new_tokens <= 0:
        raise UserError("--transfer-limit and --transfer-max-new-tokens must be positive", "delft compare",
                        "e.g. --transfer-limit 100, or --no-transfer to skip the transfer set.")
    out = Path(out)
    check_output_dir(out, "--out")  # before hours of training, not after
    contenders = resolve_contenders(recipe_paths, overrides, console)
    check_unsharded(contenders, "delft compare", "--nproc", nproc)
    cfg0 = contenders[0].for_seed(seeds[0])
    transfer_cfg = transfer_data(cfg0, transfer, transfer_format, transfer_limit) if transfer and not no_transfer \
        else None
    keys = ["synthetic"] + ([_transfer_key(transfer_cfg)] if transfer_cfg is not None else [])
    check_results_out(out, (REPORT, TABLES, SUMMARY), [_plot_path(out, k).name for k in keys],
                      [c.for_seed(s).output.dir for s in seeds for c in contenders], force, "--out")
    if transfer_cfg is not None:
        refuse_seen_before_training(transfer_cfg, cfg0.data, f"the transfer set {transfer}", "--transfer", allow_seen)
    command = _command(recipe_paths, seeds, out, overrides, nproc)
    announce(contenders, seeds, cfg0, transfer_cfg, console)
    runs, training = train_all(contenders, seeds, console, command, nproc)

    # the settings delft eval would use with the first recipe
    _, base, synth_cfg, limit, _ = resolve_settings(contenders[0].path, [str(p) for p in runs.values()], None, None,
                                                    None, None, overrides, console)
    check_runs([str(p) for p in runs.values()], base)
    tables = tables_console()
    sets = {"synthetic": evaluate_set("synthetic", synth_cfg, cfg0, base, contenders, seeds, runs, console, tables,
                                      allow_seen=allow_seen)}
    if transfer_cfg is not None:
        tcfg = cfg0.model_copy(deep=True)
        tcfg.eval.max_new_tokens = transfer_max_new_tokens
        key = _transfer_key(transfer_cfg)
        sets[key] = evaluate_set(key, transfer_cfg, tcfg, base, contenders, seeds, runs, console, tables,
                                 allow_seen=allow_seen)

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
