"""A study's comparisons with the seed as the unit: every greedy set's exact match of each recipe against the
reference, by a hierarchical bootstrap over seeds and problems (delft.evaluation.metrics.hierarchical_difference),
a t interval over the seeds' own differences, and Holm's correction over all the study's comparisons. The
per-problem pooled intervals of the rest of the report leave seed variance out; these put it in.
"""

from __future__ import annotations

from delft.evaluation.metrics import hierarchical_difference, holm, seed_level_difference

RESAMPLES = 2000


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
            rows.append({"set": key, "recipe": name, "reference": ref, "metric": "exact_match", "seeds": seeds,
                         "hierarchical": h, "seed_level": t})
    for row, adjusted in zip(rows, holm([r["hierarchical"]["p"] for r in rows])):
        row["holm_p"] = adjusted
    return rows


def seed_level_lines(rows: list[dict]) -> list[str]:
    """The summary's section on the rows of :func:`seed_analysis`."""
    if not rows:
        return []

    def pts(x: float) -> str:
        return f"{100 * x:+.1f}"

    lines = ["## With the seed as the unit", "",
             f"Exact match, recipe minus reference. Hierarchical: a bootstrap over seeds, then problems ({RESAMPLES} "
             "resamples), its two-sided p-value and Holm's correction over every comparison here. Seeds: each seed's "
             "difference and a t interval over them (wide with few seeds).", "",
             "| set | recipe | hierarchical [95 % CI] | p | Holm p | per seed | t interval over seeds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        h, t = r["hierarchical"], r["seed_level"]
        ci = f"[{pts(t['ci'][0])}, {pts(t['ci'][1])}]" if t["ci"] else "-"
        lines.append(f"| {r['set']} | {r['recipe']} vs {r['reference']} | {pts(h['difference'])} "
                     f"[{pts(h['ci'][0])}, {pts(h['ci'][1])}] | {h['p']:.3f} | {r['holm_p']:.3f} | "
                     f"{', '.join(pts(d) for d in t['per_seed'])} | {ci} |")
    lines.append("")
    return lines
