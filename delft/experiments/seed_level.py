"""A study's comparisons with the seed as the unit: every greedy set's exact match (and, with a curve, the area
under its learning curve) of each recipe against the reference, by a hierarchical bootstrap over seeds and
problems (delft.evaluation.metrics.hierarchical_difference), a t interval over the seeds' own differences, and
Holm's correction over all the study's comparisons. The per-problem pooled intervals of the rest of the report
leave seed variance out; these put it in. ``verdicts`` reads them against the study's margin and its controls.
"""

from __future__ import annotations

from typing import Optional

from delft.evaluation.metrics import EXACT_MATCH, hierarchical_difference, holm, seed_level_difference
from delft.outputs import tables_console

RESAMPLES = 2000


def analyse(report: dict, controls: list[str], margin_points: float) -> dict:
    """The report's seed-level rows, verdicts and flipped answers (what study.json keeps beside the sections)."""
    rows = seed_analysis(report)
    return {"seed_level": rows, "verdicts": verdicts(rows, controls, margin_points), "flips": flips(report)}


def seed_analysis(report: dict) -> list[dict]:
    """One row per (greedy set, recipe other than the reference): difference, intervals, p and Holm's p."""
    rows = []
    for key, sec in report["evals"].items():
        if sec["settings"]["mode"] != "greedy":
            continue  # teacher-forced sets are token-level CE and accuracy: not scored here
        ref = sec["settings"]["reference"]
        scores: dict[str, dict[int, list[float]]] = {}
        for m in sec["models"]:
            if m.get("recipe") is not None:
                scores.setdefault(m["recipe"], {})[m["seed"]] = [float(p["exact"]) for p in m["predictions"]]
        seeds = sorted(scores.get(ref, {}))
        for name, by_seed in scores.items():
            if name == ref or sorted(by_seed) != seeds:
                continue
            a, b = [scores[ref][s] for s in seeds], [by_seed[s] for s in seeds]
            h, t = hierarchical_difference(a, b, RESAMPLES), seed_level_difference(a, b)
            rows.append({"set": key, "recipe": name, "reference": ref, "metric": EXACT_MATCH.key, "seeds": seeds,
                         "hierarchical": h, "seed_level": t, "levels": _levels(a, b)})
    rows += _curve_rows(report.get("curves") or {})
    for row, adjusted in zip(rows, holm([r["hierarchical"]["p"] for r in rows])):
        row["holm_p"] = adjusted
    return rows


def _levels(ref: list, arm: list) -> dict:
    """The two sides' mean scores over seeds and problems (a floor at 0 makes a comparison blind)."""
    def mean(rows):
        return sum(sum(r) / len(r) for r in rows) / len(rows)

    return {"reference": mean(ref), "recipe": mean(arm)}


def _curve_rows(curves: dict) -> list[dict]:
    """The area under each recipe's exact-match curve against the reference's, per set."""
    rows = []
    for key, c in curves.items():
        ref = c["reference"]
        by_seed = {name: {int(s): v for s, v in arm["auc_per_problem"].items()} for name, arm in c["recipes"].items()}
        seeds = sorted(by_seed[ref])
        for name, scores in by_seed.items():
            if name == ref or sorted(scores) != seeds:
                continue
            a, b = [by_seed[ref][s] for s in seeds], [scores[s] for s in seeds]
            rows.append({"set": key, "recipe": name, "reference": ref, "metric": "exact_match_auc", "seeds": seeds,
                         "hierarchical": hierarchical_difference(a, b, RESAMPLES), "seed_level":
                         seed_level_difference(a, b), "levels": _levels(a, b)})
    return rows


ALPHA = 0.05  # the family-wise level the verdicts use (Holm-adjusted p-values)


def verdicts(rows: list[dict], controls: list[str], margin_points: float) -> dict:
    """The study's reading, by the rules its file states: whether each control moved (Holm p < ALPHA on some row),
    and for every other (set, metric, recipe): confirmed (at least ``margin`` better on every seed and Holm
    p < ALPHA), refuted (the t interval over seeds within +-margin, or below 0, while a control moved), not
    readable (there are controls and none moved, or both sides score 0 everywhere: the design cannot see an
    effect), or inconclusive."""
    margin = margin_points / 100
    moved = {c: [r for r in rows if r["recipe"] == c and r["holm_p"] < ALPHA] for c in controls}
    any_moved = any(moved.values())
    arms = []
    for r in rows:
        if r["recipe"] in controls:
            continue
        t, levels = r["seed_level"], r.get("levels") or {}
        if all(d >= margin for d in t["per_seed"]) and r["holm_p"] < ALPHA:
            verdict = "confirmed"
        elif (controls and not any_moved) or (levels and max(levels.values()) == 0):
            verdict = "not readable"  # no control moved, or neither side answers a single problem (a floor)
        elif t["ci"] is not None and (t["ci"][1] < 0 or (-margin < t["ci"][0] and t["ci"][1] < margin)) \
                and (any_moved or not controls):
            verdict = "refuted"
        else:
            verdict = "inconclusive"
        arms.append({"set": r["set"], "metric": r["metric"], "recipe": r["recipe"], "verdict": verdict})
    return {"margin_points": margin_points, "alpha": ALPHA,
            "controls": {c: [{"set": r["set"], "metric": r["metric"], "difference": r["hierarchical"]["difference"],
                              "holm_p": r["holm_p"]} for r in m] for c, m in moved.items()},
            "arms": arms}


def verdict_lines(v: Optional[dict]) -> list[str]:
    """The summary's section on :func:`verdicts`."""
    if not v or (not v["arms"] and not v["controls"]):
        return []
    lines = ["## Verdicts", "", f"By the rules the study file states: margin {v['margin_points']:g} points, Holm "
             f"p < {v['alpha']:g}. Confirmed: at least the margin better on every seed and Holm p below the level. "
             "Refuted: the t interval over seeds inside +-margin or below 0, while a control moved. Not readable: "
             "no control moved, or no model answers a single problem (a floor), so the design could not have seen "
             "a digit-loss effect.", ""]
    if not v["controls"]:
        lines[-2] += (" This study declares no control: its refutations rest on the interval alone, and nothing "
                      "shows that the design could have seen an effect.")
    for control, rows in v["controls"].items():
        if rows:
            where = "; ".join(f"{r['set']} {r['metric']} {100 * r['difference']:+.1f} points (Holm p "
                              f"{r['holm_p']:.3f})" for r in rows)
            lines.append(f"- Control **{control}** moved: {where}.")
        else:
            lines.append(f"- Control **{control}** did not move (no comparison with Holm p < {v['alpha']:g}): the "
                         "design cannot see a digit-loss effect here, so the other arms are not read as no effect.")
    for a in v["arms"]:
        lines.append(f"- {a['recipe']} on {a['set']} ({a['metric']}): **{a['verdict']}**.")
    lines.append("")
    return lines


def flips(report: dict) -> list[dict]:
    """Per greedy set: how many problems each recipe's run turns from right to wrong or back against the
    reference's run of the same seed, beside what a new seed does to the reference itself (its seed pairs). An arm
    that flips far fewer answers than a new seed is nearly the reference, whatever its interval says."""
    from itertools import combinations

    out = []
    for key, sec in report["evals"].items():
        if sec["settings"]["mode"] != "greedy":
            continue
        ref = sec["settings"]["reference"]
        exact = {(m["recipe"], m["seed"]): [bool(p["exact"]) for p in m["predictions"]] for m in sec["models"]
                 if m.get("recipe") is not None}
        seeds = sorted(s for r, s in exact if r == ref)

        def count(a, b):
            return sum(x != y for x, y in zip(exact[a], exact[b]))

        arms = {r: {s: count((ref, s), (r, s)) for s in seeds if (r, s) in exact}
                for r in dict.fromkeys(r for r, _ in exact) if r != ref}
        out.append({"set": key, "reference": ref, "n": len(sec["problems"]), "arms": arms,
                    "reference_seed_pairs": {f"{a}-{b}": count((ref, a), (ref, b)) for a, b in combinations(seeds, 2)}})
    return out


def flip_lines(rows: list[dict]) -> list[str]:
    """The summary's section on :func:`flips`."""
    if not rows:
        return []
    lines = ["## Answers that changed", "", "Problems whose exact-match verdict (right or wrong) differs from the "
             "reference's run of the same seed; the last column is what a new seed does to the reference itself.", "",
             "| set | recipe | flipped, per seed | the reference, seed against seed |", "|---|---|---|---|"]
    for r in rows:
        noise = ", ".join(f"{v} ({k})" for k, v in r["reference_seed_pairs"].items()) or "- (one seed)"
        for name, per_seed in r["arms"].items():
            lines.append(f"| {r['set']} (n={r['n']}) | {name} vs {r['reference']} | "
                         f"{', '.join(str(v) for v in per_seed.values())} | {noise} |")
    lines.append("")
    return lines


SEED_LEVEL_COLUMNS = ("set", "metric", "recipe", "hierarchical [95 % CI]", "p", "Holm p", "per seed",
                      "t interval over seeds")


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def seed_level_cells(r: dict) -> list[str]:
    """One row of :func:`seed_analysis` as the cells of SEED_LEVEL_COLUMNS (summary.md and tables.txt alike)."""
    h, t = r["hierarchical"], r["seed_level"]
    ci = f"[{_pts(t['ci'][0])}, {_pts(t['ci'][1])}]" if t["ci"] else "-"
    return [r["set"], r["metric"], f"{r['recipe']} vs {r['reference']}",
            f"{_pts(h['difference'])} [{_pts(h['ci'][0])}, {_pts(h['ci'][1])}]", f"{h['p']:.3f}",
            f"{r['holm_p']:.3f}", ", ".join(_pts(d) for d in t["per_seed"]), ci]


def seed_level_lines(rows: list[dict]) -> list[str]:
    """The summary's section on the rows of :func:`seed_analysis`."""
    if not rows:
        return []
    auc = " (exact_match_auc: the area under its learning curve)" if any(
        r["metric"] == "exact_match_auc" for r in rows) else ""
    lines = ["## With the seed as the unit", "",
             f"Exact match{auc}, recipe minus reference. Hierarchical: a bootstrap over seeds, then problems "
             f"({RESAMPLES} resamples), its two-sided p-value and Holm's correction over every comparison here. "
             "Seeds: each seed's difference and a t interval over them (wide with few seeds).", "",
             "| " + " | ".join(SEED_LEVEL_COLUMNS) + " |", "|" + "---|" * len(SEED_LEVEL_COLUMNS)]
    lines += ["| " + " | ".join(seed_level_cells(r)) + " |" for r in rows]
    lines.append("")
    return lines


TABLES_HEADING = "delft study, with the seed as the unit"  # marks the block in tables.txt that a rewrite replaces


def analysis_renderables(report: dict) -> list:
    """The seed-level rows and the verdicts as rich renderables: the terminal's and tables.txt's view of what
    summary.md says in its sections on them."""
    from rich.table import Table

    rows = report.get("seed_level") or []
    if not rows:
        return []
    table = Table(title=f"{TABLES_HEADING}: recipe minus reference, points (hierarchical bootstrap over seeds, "
                        "then problems; Holm over every row)")
    for column in SEED_LEVEL_COLUMNS:
        table.add_column(column)
    for r in rows:
        table.add_row(*seed_level_cells(r))
    verdict = [line.replace("**", "") for line in verdict_lines(report.get("verdicts"))[2:] if line]
    return [table, *verdict, ""]


def analysis_text(report: dict) -> str:
    """:func:`analysis_renderables` as plain text, the way tables.txt records the terminal."""
    text = tables_console()
    for item in analysis_renderables(report):
        text.print(item, highlight=False)
    return text.export_text()
