"""``delft study``'s summary.md: the differences from the reference first (per seed, pooled, and the smallest
difference each comparison can detect), then every set's full tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from delft.data.sources import normalised_prompt
from delft.errors import UserError
from delft.evaluation.contamination import mix_line, training_prompts
from delft.evaluation.metrics import PAIRED
from delft.evaluation.teacher_forced import ARGMAX_ACCURACY
from delft.experiments.breakdown import BREAKDOWN_HEADING, breakdown, breakdown_lines
from delft.experiments.curves import curve_lines
from delft.experiments.power import plan_lines
from delft.experiments.reproduction import REPRODUCTION_HEADING, reproduction_lines
from delft.experiments.results import markdown_set
from delft.experiments.seed_level import (
    MARGIN,
    TABLES_HEADING,
    analyse,
    analysis_text,
    flip_lines,
    flips,
    seed_level_lines,
    verdict_lines,
)
from delft.experiments.transitions import transition_lines
from delft.losses.registry import LOSS_TYPES
from delft.outputs import pct, result_set, write_result
from delft.recipe.files import read_yaml
from delft.recipe.schema import validate_recipe

# The headline metrics: (group in the teacher-forced differences, metric, label, scale) per mode; a greedy set's
# are the metrics every comparison differences (delft.evaluation.metrics.PAIRED).
GREEDY_HEADLINE = tuple((m.key, f"{m.name}, points", 100) for m in PAIRED)


TEACHER_HEADLINE = (("digits", ARGMAX_ACCURACY, "teacher-forced digit accuracy, points", 100),
                    ("digits", "digit_ce", "digit CE, nats", 1), ("text", "text_ce", "non-digit CE, nats", 1))


def _signed(d: Optional[dict], scale: float) -> str:
    if not d or d.get("difference") is None:
        return "-"
    ci = d["ci"]
    digits = 1 if scale == 100 else 3
    span = f" [{scale * ci[0]:+.{digits}f}, {scale * ci[1]:+.{digits}f}]" if ci else ""
    return f"{scale * d['difference']:+.{digits}f}{span}"


def _pick(diff: Optional[dict], mode: str, spec: tuple) -> Optional[dict]:
    if not diff:
        return None
    if mode == "greedy":
        return diff.get(spec[0])
    return diff.get(spec[0], {}).get(spec[1])


def _pooled(sec: dict, seeds: list[int]) -> list[tuple[str, Optional[dict]]]:
    """(recipe, its pooled difference from the reference): the seed means' or, with one training seed (a greedy
    set has no seed means then), that seed's own difference."""
    if sec["means"] or len(seeds) != 1:
        return [(mean["name"], mean["vs_reference"]) for mean in sec["means"]]
    return [(m["recipe"], m["vs_reference"]) for m in sec["models"] if m["seed"] == seeds[0]]


def headline(key: str, sec: dict, seeds: list[int]) -> list[str]:
    """Per compared recipe: its difference from the reference on each seed and pooled over seeds (intervals over
    problems only: what the seeds can detect is the seed-level section's)."""
    mode = sec["settings"]["mode"]
    ref = sec["settings"]["reference"]
    specs = GREEDY_HEADLINE if mode == "greedy" else TEACHER_HEADLINE
    by = {(m["recipe"], m["seed"]): m for m in sec["models"]}
    lines = [f"#### {key} ({sec['settings']['n']} problems, {mode.replace('_', '-')}): difference from {ref}", "",
             "| recipe | metric | " + " | ".join(f"seed {s}" for s in seeds)
             + " | pooled [95 % CI over problems] |",
             "|---|---|" + "---|" * (len(seeds) + 1)]
    for name, vs_ref in _pooled(sec, seeds):
        if vs_ref is None:
            continue
        for spec in specs:
            scale, label = spec[-1], spec[-2]
            cells = [_signed(_pick(by[(name, s)]["vs_reference"], mode, spec), scale) for s in seeds]
            pooled = _pick(vs_ref, mode, spec)
            lines.append(f"| {name} | {label} | " + " | ".join(cells)
                         + f" | {_signed(pooled, scale)} |")
    lines.append("")
    return lines


def _nats(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def teacher_tables(key: str, sec: dict) -> list[str]:
    """A teacher-forced set: overall digit metrics and non-digit CE per model, then per-place digit accuracy."""
    st = sec["settings"]
    ordered = [("base", sec["models"][0]["metrics"])]  # then each recipe's seeds and their mean
    for mean in sec["means"]:
        ordered += [(f"{m['recipe']} (seed {m['seed']})", m["metrics"]) for m in sec["models"]
                    if m["recipe"] == mean["name"]]
        ordered.append((f"**{mean['name']} (mean)**", mean["metrics"]))
    first = ordered[0][1]
    lines = [f"### {key}: {st['n']} gold completions, teacher-forced ({first['truncated']} truncated)", "",
             f"| model | digit argmax accuracy % (n={first['digits']['n']}) | full-vocab argmax accuracy % | "
             f"digit CE | non-digit CE (n={first['text']['n']}) | non-digit perplexity |",
             "|---|---|---|---|---|---|"]
    for label, m in ordered:
        d, t = m["digits"], m["text"]
        lines.append(f"| {label} | {pct(d[ARGMAX_ACCURACY], unit='')} | {pct(d['full_accuracy'], unit='')} | "
                     f"{_nats(d['digit_ce'])} | {_nats(t['ce'])} | {_nats(t['perplexity'])} |")
    places = list(first["per_place"])
    lines += ["", "Teacher-forced digit argmax accuracy per place, % (n = digit positions at that place):", "",
              "| model | " + " | ".join(f"{p} (n={first['per_place'][p]['n']})" for p in places) + " |",
              "|---|" + "---|" * len(places)]
    for label, m in ordered:
        lines.append(f"| {label} | " + " | ".join(pct(m["per_place"].get(p, {}).get(ARGMAX_ACCURACY), unit='')
                                                 for p in places) + " |")
    lines.append("")
    return lines


def study_summary(report: dict) -> str:
    seeds = report["settings"]["seeds"]
    secs = report["seconds"]
    asked = report.get("description", "").strip()
    lines = (["## The question and what would answer it (written before the study ran)", "", asked, ""] if asked
             else [])
    gated = bool(report["settings"].get("calibrators"))  # a calibrator's verdict first: nothing is read without it
    lines += verdict_lines(report.get("verdicts")) if gated else []
    lines += [f"Generated by `{report['command']}` (delft {report['delft_version']}); wall time "
              f"{secs['total'] / 60:.0f} min ({secs['training'] / 60:.0f} min of it training what was missing).", "",
              "## Losses", "", "| recipe | loss | weight | normalisation | place weights |", "|---|---|---|---|---|"]
    controls = report["settings"].get("controls") or []
    for name, loss in report["settings"]["losses"].items():
        kind = LOSS_TYPES[loss["type"]]  # ce and dft have no digit term to weigh, normalise or weigh by place
        label = f"{name}{' (control)' if name in controls else ''}"
        lines.append(f"| {label} | {loss['type']} | {loss['weight'] if kind.has_term else '-'} | "
                     f"{loss['normalisation'] if kind.has_term else '-'} | "
                     f"{loss['place_weights'] if kind.place_weighted else '-'} |")
    lines += ["", "## Differences from the reference", "",
              "Paired bootstrap over the same problems (95 % CI). Pooled: each problem's score averaged over the "
              "seeds first. These intervals resample problems only and leave the variation between seeds out; they "
              "are not what decides. Where the seeds differ more than the problems' noise (from scratch) they are "
              "narrower than what the study can tell apart; where every seed sees the same problems and the seeds "
              "barely differ (LoRA) the problems carry the spread and they can be wider than the t interval over "
              "seeds, which holds the problems fixed. The verdicts, the two-way interval that counts both and the "
              "detectable differences are the next sections'.", ""]
    for key, sec in report["evals"].items():
        lines += headline(key, sec, seeds)
        if sec["settings"].get("mix"):
            lines += [f"Mix of {mix_line(key, sec['settings']['mix'])} (leaving the training problems and their "
                      "commuted forms out shifts it).", ""]
    lines += plan_lines(report["settings"].get("plan"))
    lines += seed_level_lines(report.get("seed_level", []))
    lines += flip_lines(report.get("flips") or flips(report))
    lines += curve_lines(report.get("curves") or {})
    lines += transition_lines(report.get("transitions"))
    lines += [] if gated else verdict_lines(report.get("verdicts"))
    lines += breakdown_lines(report["breakdown"] if "breakdown" in report else breakdown(report))
    lines += reproduction_lines(report.get("reproduction"))
    lines += ["## Every set in full", ""]
    for key, sec in report["evals"].items():
        if sec["settings"]["mode"] == "teacher_forced":
            lines += teacher_tables(key, sec)
        else:
            lines += markdown_set(key, sec, sec["settings"]["reference"])
    return "\n".join(lines)


def _margin_stated(study_file: Optional[str]) -> Optional[bool]:
    """Whether a study file states its margin (for a study.json written before delft recorded it); None when the
    file is gone."""
    path = Path(study_file) if study_file else None
    if path is None or not path.is_file():
        return None
    return "margin" in (read_yaml(path) or {})


def count_stored(report: dict) -> None:
    """For a study.json written before delft counted contamination: each greedy set's problems that the runs
    trained on, from the study's recipe (its runs share one data section) and each problem's stored question,
    recorded on every run as ``delft study`` now records it (the base model trained on none)."""
    sections = [s for s in report["evals"].values() if s["settings"]["mode"] == "greedy"
                and any("contamination" not in m for m in s["models"] if m.get("recipe") is not None)]
    if not sections:
        return
    prompts = training_prompts(validate_recipe(report["settings"]["recipe"]).data)
    for sec in sections:
        seen = [p["index"] for p in sec["problems"] if normalised_prompt(p["question"]) in prompts]
        for m in sec["models"]:
            if m.get("recipe") is not None:
                m["contamination"] = {"seen_in_training": len(seen), "n": len(sec["problems"]), "seen_problems": seen,
                                      "counted": "afterwards, from the study's recipe and the stored questions"}


BLOCK_HEADINGS = (TABLES_HEADING, BREAKDOWN_HEADING, REPRODUCTION_HEADING)  # what may start tables.txt's analysis


def tables_before_analysis(tables: str) -> str:
    """tables.txt's evaluation tables: its analysis block (from the start of the line its first heading is on)
    cut off, so that writing it again replaces it."""
    starts = [tables.index(h) for h in BLOCK_HEADINGS if h in tables]
    return tables[:tables.rfind("\n", 0, min(starts)) + 1] if starts else tables


def rewrite(out: Path, study_file: Optional[str] = None, flag: str = "out") -> None:
    """Recompute a study's analysis (seed-level rows, verdicts, flipped answers, the endpoints by group, the
    pilot's runs reproduced) from its study.json with this code, counting its runs' training problems in its sets
    first when it was written before delft did, and write study.json, summary.md and tables.txt's analysis block
    again, all three written in full beside ``out`` before any replaces its old copy (``delft study FILE
    --report``; ``python bench/study_rewrite.py OUT``). ``study_file`` names the pilot (default: the one the report
    records); the evaluation tables at the top of tables.txt are kept as they are."""
    out = Path(out)
    if not (out / "study.json").is_file():
        raise UserError(f"{out / 'study.json'} is not there: the study has not written its results yet, so there "
                        "is no report to write again", flag, "Run the study to the end first (delft study FILE "
                        "writes study.json once every run is evaluated); --report only rewrites what it wrote.")
    report = json.loads((out / "study.json").read_text())
    settings = report["settings"]
    count_stored(report)
    report.update(analyse(report, settings.get("controls") or [], settings.get("margin", MARGIN),
                          settings.get("margin_stated", _margin_stated(report.get("study"))), study_file))
    tables = (out / "tables.txt").read_text() if (out / "tables.txt").exists() else ""
    with result_set(out, (), flag) as new:
        write_result(new / "study.json", json.dumps(report, indent=1) + "\n", flag)
        write_result(new / "summary.md", study_summary(report), flag)
        write_result(new / "tables.txt", tables_before_analysis(tables) + analysis_text(report), flag)
