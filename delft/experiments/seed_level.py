"""A study's comparisons with the seed as the unit, and the verdicts they license.

Every greedy set's exact match (and, with a curve, the area under its learning curve) of each recipe against the
reference: each seed's difference, the paired t test over seeds, the two-way (seed x problem) interval, the exact
sign-flip and Wilcoxon tests, the hierarchical bootstrap over seeds then problems as a descriptive interval, and
the smallest difference the seeds could detect (delft.experiments.seed_tests says why each test has the role it
has). The study file's ``decide`` names the test that decides (default the t test; ``two_way`` where every seed
sees the same problems; ``sign_flip`` or ``wilcoxon`` from scratch with many seeds), Holm-corrected over the
study's family: every row but a calibrator's (tested alone, at the level) and the endpoints the plan listed as
descriptive (they cannot reach the level). ``verdicts`` reads the rows against the study's margin, its positive
controls and its calibrators.
"""

from __future__ import annotations

from typing import Optional

from delft.errors import UserError
from delft.evaluation.metrics import EXACT_MATCH
from delft.experiments.breakdown import breakdown, breakdown_renderables
from delft.experiments.reproduction import pilot_reproduction, reproduction_renderables, study_pilot
from delft.experiments.seed_tests import (
    ALPHA,
    detectable_difference,
    hierarchical_bootstrap,
    holm,
    seed_differences,
    seed_spread,
    sign_flip_test,
    t_test,
    tost,
    two_way_test,
    wilcoxon_test,
)
from delft.experiments.transitions import LEARNED, STEPS_SOONER, transition_rows
from delft.outputs import tables_console

RESAMPLES = 2000
FLOOR = 0.02  # a side scoring below 2 % on a set sits on the floor: "no difference" there says nothing
MARGIN = 3.0  # points: a study file's margin when it states none (the verdicts say which it was)
VERDICTS = ("better", "worse", "equivalent", "inconclusive", "not readable", "descriptive")
DECIDERS = {"t": "t_test", "two_way": "two_way", "sign_flip": "sign_flip", "wilcoxon": "wilcoxon"}  # decide: -> row key
TEST_NAMES = {"t_test": "t test over seeds", "two_way": "two-way interval over seeds and problems",
              "sign_flip": "sign-flip test over seeds", "wilcoxon": "Wilcoxon signed-rank test over seeds"}


def analyse(report: dict, controls: list[str], margin_points: float, margin_stated: Optional[bool],
            study_file: Optional[str] = None) -> dict:
    """The report's seed-level rows, verdicts and flipped answers, its descriptive endpoints by group, and how its
    runs compare with the pilot's of the same name (the pilot that ``study_file``, by default the report's own
    study file, names): what study.json keeps beside the sections."""
    rows = seed_analysis(report)
    calibrators = report["settings"].get("calibrators") or []
    return {"seed_level": rows, "verdicts": verdicts(rows, controls, margin_points, margin_stated, calibrators,
                                                     report["settings"].get("decide", "t")),
            "flips": flips(report), "breakdown": breakdown(report),
            "reproduction": pilot_reproduction(report, study_pilot(study_file or report.get("study")))}


def scores_by_seed(sec: dict, keep: Optional[list[int]] = None) -> dict[str, dict[int, list[float]]]:
    """A greedy set's per-problem exact match, by recipe and seed (only the problems at positions ``keep``)."""
    scores: dict[str, dict[int, list[float]]] = {}
    for m in sec["models"]:
        if m.get("recipe") is not None:
            flags = [float(p["exact"]) for p in m["predictions"]]
            scores.setdefault(m["recipe"], {})[m["seed"]] = flags if keep is None else [flags[i] for i in keep]
    return scores


UNSEEN = "{key} (unseen)"  # the rows on a set's problems that no run trained on, beside the whole set's


def unseen_positions(sec: dict) -> Optional[list[int]]:
    """The positions of a set's problems that no compared run trained on (delft.evaluation.contamination's
    records), or None when no run trained on any of them. The runs of a study share their training data, so one
    subset serves every pair."""
    seen = set()
    for m in sec["models"]:  # commuted near-duplicates (b + a of a trained a + b) are not unseen either
        record = m.get("contamination") or {}
        seen.update((record.get("seen_problems") or []) + (record.get("near_duplicate_problems") or []))
    if not seen:
        return None
    first = next(m for m in sec["models"] if m.get("recipe") is not None)
    return [i for i, p in enumerate(first["predictions"]) if p["index"] not in seen]


def _set_rows(key: str, sec: dict, keep: Optional[list[int]], decide: str = "t") -> list[dict]:
    """One row per recipe other than the reference on one greedy set (or its problems at ``keep``)."""
    ref = sec["settings"]["reference"]
    scores = scores_by_seed(sec, keep)
    seeds = _check_seeds(f"study.json: evals.{key}", scores, ref)
    name = key if keep is None else UNSEEN.format(key=key)
    return [comparison({"set": name, "recipe": r, "reference": ref, "metric": EXACT_MATCH.key, "seeds": seeds,
                        "problems": len(scores[ref][seeds[0]])}, [scores[ref][s] for s in seeds],
                       [by_seed[s] for s in seeds], decide) for r, by_seed in scores.items() if r != ref]


def _check_seeds(where: str, by_recipe: dict[str, dict], ref: str) -> list[int]:
    """The reference's seeds; every recipe must have exactly those (a missing run is an error, not a dropped row)."""
    seeds = sorted(by_recipe.get(ref, {}))
    for name, by_seed in by_recipe.items():
        if sorted(by_seed) != seeds:
            missing = sorted(set(seeds) - set(by_seed)) or sorted(set(by_seed) - set(seeds))
            raise UserError(f"{name} has seeds {sorted(by_seed)} where the reference {ref} has {seeds} (seed "
                            f"{missing} on one side only): the seeds are the pairs every test is over, and dropping "
                            "a recipe's row would hide it", where,
                            "Train and evaluate the missing runs (delft study reuses the finished ones), then rerun.")
    return seeds


def comparison(where: dict, ref_scores: list, arm_scores: list, decide: str = "t") -> dict:
    """One comparison: the seeds' differences, the t test, the two-way interval, the sign-flip and Wilcoxon tests,
    the descriptive bootstrap, the spread over seeds and the difference it could detect; ``decides`` names the row
    key of the test the study file's ``decide`` chose."""
    per_seed = seed_differences(ref_scores, arm_scores)
    t = t_test(per_seed)
    spread = seed_spread(per_seed)
    return {**where, "difference": t["difference"], "t_test": t, "sign_flip": sign_flip_test(per_seed),
            "two_way": two_way_test(ref_scores, arm_scores), "wilcoxon": wilcoxon_test(per_seed),
            "bootstrap": hierarchical_bootstrap(ref_scores, arm_scores, RESAMPLES), "spread": spread,
            "detectable": detectable_difference(spread, len(per_seed)), "levels": _levels(ref_scores, arm_scores),
            "decides": DECIDERS[decide]}


def seed_analysis(report: dict) -> list[dict]:
    """One row per (greedy set, recipe other than the reference), and per the set's unseen problems when runs
    trained on some of it; then the curves' areas, likewise; Holm over all rows."""
    rows, unseen = [], {}
    decide = report.get("settings", {}).get("decide", "t")
    for key, sec in report["evals"].items():
        if sec["settings"]["mode"] != "greedy":
            continue  # teacher-forced sets are token-level CE and accuracy: not scored here
        rows += _set_rows(key, sec, None, decide)
        unseen[key] = unseen_positions(sec)
        if unseen[key] is not None:
            rows += _set_rows(key, sec, unseen[key], decide)
    rows += _curve_rows(report.get("curves") or {}, unseen, decide)
    transitions = report.get("transitions")
    if transitions:
        by_recipe = {name: {int(s): v for s, v in per_seed.items()}
                     for name, per_seed in transitions["recipes"].items()}
        rows += transition_rows(transitions, _check_seeds("study.json: transitions", by_recipe,
                                                          transitions["reference"]))
    _mark_family(rows, report.get("settings", {}))
    family = [r for r in rows if r["family"] is None]
    p = [deciding_p(r) for r in family]
    for r in rows:
        r["holm_p"] = None
    if None in p:  # one seed: no test over seeds, nothing to adjust
        return rows
    for row, adjusted in zip(family, holm(p)):
        row["holm_p"] = adjusted
    return rows


def _mark_family(rows: list[dict], settings: dict) -> None:
    """Each row's place in Holm's family: None (in it), 'calibrator' (tested alone at ALPHA: it gates the study,
    it is not one of its findings) or 'descriptive' (an endpoint the plan showed cannot reach the level)."""
    calibrators = settings.get("calibrators") or []
    descriptive = {(d["recipe"], d["metric"]) for d in (settings.get("plan") or {}).get("descriptive") or []}
    for r in rows:
        r["family"] = ("calibrator" if r["recipe"] in calibrators else
                       "descriptive" if (r["recipe"], r["metric"]) in descriptive else None)


def deciding_p(row: dict) -> Optional[float]:
    """The p of the test that decides a row: the t test over seeds, or the sign-flip test where the row says so
    (delft.experiments.transitions: censored steps and 0/1 outcomes)."""
    return row[row.get("decides", "t_test")]["p"]


def _levels(ref: list, arm: list) -> dict:
    """The two sides' mean scores over seeds and problems (a floor makes a comparison blind)."""
    def mean(rows):
        return sum(sum(r) / len(r) for r in rows) / len(rows)

    return {"reference": mean(ref), "recipe": mean(arm)}


def _curve_rows(curves: dict, unseen: dict[str, Optional[list[int]]], decide: str = "t") -> list[dict]:
    """The area under each recipe's exact-match curve against the reference's, per set (and its unseen problems)."""
    rows = []
    for key, c in curves.items():
        ref = c["reference"]
        by_seed = {name: {int(s): v for s, v in arm["auc_per_problem"].items()} for name, arm in c["recipes"].items()}
        seeds = _check_seeds(f"study.json: curves.{key}", by_seed, ref)
        for keep in (None, unseen.get(key)) if unseen.get(key) is not None else (None,):
            part = {n: {s: v if keep is None else [v[i] for i in keep] for s, v in sc.items()}
                    for n, sc in by_seed.items()}
            rows += [comparison({"set": key if keep is None else UNSEEN.format(key=key), "recipe": name,
                                 "reference": ref, "metric": "exact_match_auc", "seeds": seeds,
                                 "problems": len(part[ref][seeds[0]])}, [part[ref][s] for s in seeds],
                                [scores[s] for s in seeds], decide) for name, scores in part.items() if name != ref]
    return rows


def _control_moves(rows: list[dict], controls: list[str]) -> dict:
    """Per control (or calibrator), each of its rows and how it moved: up or down (its p below ALPHA: Holm's for a
    control, its own for a calibrator, which is tested alone) or not."""
    out = {}
    for c in controls:
        out[c] = [{"set": r["set"], "metric": r["metric"], "difference": r["difference"], "holm_p": r["holm_p"],
                   "p": r[r.get("decides", "t_test")].get("p"), "unit": r.get("unit", "points"),
                   "moved": _direction(r)}
                  for r in rows if r["recipe"] == c]
    return out


MOVES = {"up": "moved up", "down": "moved down (significant, the wrong way)", "no": "did not move"}


def _direction(r: dict) -> str:
    p = deciding_p(r) if r.get("family") == "calibrator" else r["holm_p"]
    if p is None or p >= ALPHA:
        return "no"
    return "up" if r["difference"] > 0 else "down"


def equivalence(r: dict, margin: float, decide: str) -> dict:
    """The row's TOST at +-``margin`` on the deciding test's standard error (the two-way one where it decides, the
    t test's otherwise): what ``decide`` other than 't' reads equivalence from."""
    test = r["two_way"] if r.get("decides") == "two_way" else r["t_test"]
    return tost(r["difference"], test.get("se"), test.get("df"), margin)


def verdict(r: dict, control_up: bool, has_controls: bool, margin: float, sensitive: bool = True,
            decide: str = "t") -> tuple[str, str]:
    """(label, why) for one arm's row, read in this order: a row outside Holm's family is descriptive; a
    significant difference (Holm p of the deciding test below ALPHA) is better or worse; otherwise a side on the
    floor, a calibrator that did not move down on this set and metric, or controls of which none moved up make the
    row not readable; otherwise equivalent (decide 't': the t interval inside +-margin; any other: TOST p below
    ALPHA at the margin), anything else inconclusive."""
    t, levels = r["t_test"], r["levels"]
    test = TEST_NAMES[r.get("decides", "t_test")]
    if r.get("family") == "descriptive":
        return "descriptive", "the plan showed this endpoint cannot reach the level: outside Holm's family"
    if r["holm_p"] is not None and r["holm_p"] < ALPHA:
        return ("better" if r["difference"] > 0 else "worse"), f"Holm p {r['holm_p']:.3g} ({test})"
    if r.get("unit", "points") != "points":
        return _endpoint_verdict(r, control_up, has_controls)
    if min(levels.values()) < FLOOR:
        return "not readable", f"a side scores below {100 * FLOOR:g} % (a floor)"
    if not sensitive:
        return "not readable", "the calibrator did not move down on this set and metric: the design is insensitive"
    if has_controls and not control_up:
        return "not readable", "no control moved up on this set and metric"
    if decide != "t":
        eq = equivalence(r, margin, decide)
        if eq["equivalent"]:
            return "equivalent", f"TOST p {eq['p']:.3g} at +-{100 * margin:g} points ({test})"
        return "inconclusive", f"TOST at +-{100 * margin:g} points ({test}) gives p " + (
            "-" if eq["p"] is None else f"{eq['p']:.3g}")
    if t["ci"] is not None and -margin < t["ci"][0] and t["ci"][1] < margin:
        return "equivalent", f"t interval over seeds inside +-{100 * margin:g} points"
    why = "t interval over seeds reaches past the margin"
    if t["ci"] is None:
        why = "one seed: no test over seeds" if len(t["per_seed"]) < 2 else "every seed differs by the same amount: " \
              "no spread, so no t interval"
    return "inconclusive", why


def _endpoint_verdict(r: dict, control_up: bool, has_controls: bool) -> tuple[str, str]:
    """An endpoint counted in steps or seeds (delft.experiments.transitions) and not significant: it has no margin
    of equivalence, so it is not readable (no run of either side learned, or no control moved up on it) or
    inconclusive."""
    if not r["learned_any"]:
        return "not readable", "no run of either side reached the share: nothing to date"
    if has_controls and not control_up:
        return "not readable", "no control moved up on this endpoint"
    return "inconclusive", "the sign-flip test over seeds finds no difference, and this endpoint has no margin of " \
                           "equivalence"


RULE_TESTS = {"t": "paired t test over seeds, Holm-adjusted",
              "two_way": "two-way (seed x problem) random-effects interval, Satterthwaite df, Holm-adjusted",
              "sign_flip": "exact sign-flip test over seeds, Holm-adjusted",
              "wilcoxon": "exact Wilcoxon signed-rank test over seeds, Holm-adjusted"}


def verdicts(rows: list[dict], controls: list[str], margin_points: float, margin_stated: Optional[bool],
             calibrators: Optional[list[str]] = None, decide: str = "t") -> dict:
    """Every arm's verdict (VERDICTS) with its reason, each control's and calibrator's moves, and the rules applied,
    each saying whether the study file stated it or delft's default filled it in."""
    margin, calibrators = margin_points / 100, calibrators or []
    moves = _control_moves(rows, controls)
    gauges = _control_moves(rows, calibrators)
    up = {(m["set"], m["metric"]) for rows_ in moves.values() for m in rows_ if m["moved"] == "up"}
    down = {(m["set"], m["metric"]) for rows_ in gauges.values() for m in rows_ if m["moved"] == "down"}
    arms = []
    for r in rows:
        if r["recipe"] in controls or r["recipe"] in calibrators:
            continue
        key = (r["set"], r["metric"])
        label, why = verdict(r, key in up, bool(controls), margin, not calibrators or key in down, decide)
        arms.append({"set": r["set"], "metric": r["metric"], "recipe": r["recipe"], "verdict": label, "why": why,
                     "tost": equivalence(r, margin, decide) if r.get("unit", "points") == "points" else None})
    stated = {True: "study file", False: "delft's default", None: "not recorded"}[margin_stated]
    return {"rules": {"margin_points": {"value": margin_points, "from": stated},
                      "alpha": {"value": ALPHA, "from": "delft's default"},
                      "test": {"value": RULE_TESTS[decide], "from": "delft's default" if decide == "t" else
                               "study file"},
                      "equivalence": {"value": "t interval inside +-margin" if decide == "t" else
                                      "TOST at +-margin (the 90 % interval inside it)",
                                      "from": "delft's default" if decide == "t" else "study file"},
                      "floor_percent": {"value": 100 * FLOOR, "from": "delft's default"}},
            "controls": moves, "calibrators": gauges, "arms": arms}


def verdict_lines(v: Optional[dict]) -> list[str]:
    """The summary's section on :func:`verdicts`."""
    if not v or (not v["arms"] and not v["controls"]):
        return []
    rules = v["rules"]
    margin = rules["margin_points"]
    stated = {"study file": "stated in the study file", "delft's default": "delft's default: the study file states "
              "none"}.get(margin["from"], "whether the study file stated it was not recorded")
    equivalent = rules.get("equivalence", {}).get("value", "t interval inside +-margin")
    lines = ["## Verdicts", "", f"Rules applied: margin {margin['value']:g} points ({stated}); level "
             f"{rules['alpha']['value']:g}, the {rules['test']['value']} and a floor of "
             f"{rules['floor_percent']['value']:g} %. Better / worse: Holm-adjusted p of the deciding test (of the "
             "sign-flip test for the transition endpoints in steps and seeds) below the level. Not readable: a side "
             "below the floor, a calibrator that did not move down, or controls of which none moved up on that set "
             f"and metric (the design could not have seen an effect). Equivalent: the {equivalent}. Descriptive: an "
             "endpoint the plan showed cannot reach the level, kept out of Holm's family. Otherwise inconclusive.", ""]
    for calibrator, moves in (v.get("calibrators") or {}).items():  # first: nothing else is read without it
        for m in moves:
            sensitive = "the design is sensitive" if m["moved"] == "down" else \
                "the design is insensitive here: no other verdict on this set and metric is read"
            lines.append(f"- Calibrator **{calibrator}** on {m['set']} ({m['metric']}): "
                         f"{UNIT_FORMATS[m.get('unit', 'points')](m['difference'])} points, p {_p(m['p'])} (alone, "
                         f"not in Holm's family): **{MOVES[m['moved']] if m['moved'] != 'down' else 'moved down'}**, "
                         f"{sensitive}.")
    calibrated = any(m["moved"] == "down" for moves in (v.get("calibrators") or {}).values() for m in moves)
    if not v["controls"] and calibrated:  # said in the rules paragraph (lines[2]), before the verdicts
        lines[2] += (" This study declares no positive control: the calibrator that moved down is what shows the "
                     "design could see an effect, a cost of its size; an 'equivalent' rests on its interval.")
    elif not v["controls"]:
        lines[2] += (" This study declares no control: an 'equivalent' rests on the interval alone, and nothing "
                     "shows that the design could have seen an effect.")
    for control, moves in v["controls"].items():
        for m in moves:
            holm_p = "-" if m["holm_p"] is None else f"{m['holm_p']:.3g}"
            unit = m.get("unit", "points")
            lines.append(f"- Control **{control}** on {m['set']} ({m['metric']}): "
                         f"{UNIT_FORMATS[unit](m['difference'])} {unit}, Holm p {holm_p}: **{MOVES[m['moved']]}**.")
    for a in v["arms"]:
        lines.append(f"- {a['recipe']} on {a['set']} ({a['metric']}): **{a['verdict']}** ({a['why']}).")
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


SEED_LEVEL_COLUMNS = ("set", "metric", "recipe", "difference", "per seed", "t interval over seeds", "t p",
                      "two-way interval, seeds x problems (p)", "Holm p", "sign-flip p (smallest possible)",
                      "bootstrap, seeds then problems", "detectable (seeds, 80 %)")


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


UNIT_FORMATS = {"points": _pts, "steps": lambda x: f"{x:+.0f}", "seeds": lambda x: f"{x:+.2f}"}  # per row unit


def _p(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


def _interval(ci: Optional[list], fmt=_pts) -> str:
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "-"


def seed_level_cells(r: dict) -> list[str]:
    """One row of :func:`seed_analysis` as the cells of SEED_LEVEL_COLUMNS (summary.md and tables.txt alike), in
    the row's unit (points of exact match; steps and seeds for delft.experiments.transitions' endpoints)."""
    t, flip, boot = r["t_test"], r["sign_flip"], r["bootstrap"]
    unit = r.get("unit", "points")
    fmt = UNIT_FORMATS[unit]
    detectable = "-" if r["detectable"] is None else fmt(r["detectable"]).lstrip("+")
    where = r["set"] + (f" (n={r['problems']})" if r.get("problems") else "")
    metric = r["metric"] + ("" if unit == "points" else f" ({unit})")
    decides = r.get("decides", "t_test")
    mark = {key: " *" if decides == key else "" for key in TEST_NAMES}
    two = r.get("two_way")
    two_way = "-" if not two or two["ci"] is None else f"{_interval(two['ci'])} ({_p(two['p'])}){mark['two_way']}"
    holm_p = _p(r["holm_p"]) if r.get("family") is None else f"- ({r['family']})"
    return [where, metric, f"{r['recipe']} vs {r['reference']}", fmt(r["difference"]),
            ", ".join(fmt(d) for d in t["per_seed"]), _interval(t["ci"], fmt), _p(t["p"]) + mark["t_test"],
            two_way, holm_p, f"{_p(flip['p'])} ({_p(flip['smallest_possible_p'])}){mark['sign_flip']}",
            "-" if boot is None else _interval(boot["ci"]), detectable]


def seed_level_lines(rows: list[dict]) -> list[str]:
    """The summary's section on the rows of :func:`seed_analysis`."""
    if not rows:
        return []
    auc = " (exact_match_auc: the area under its learning curve)" if any(
        r["metric"] == "exact_match_auc" for r in rows) else ""
    lines = ["## With the seed as the unit", "",
             f"Exact match{auc}, recipe minus reference, points. The seeds are the observations: each seed's "
             "difference, the paired t test over them (its interval and p), the two-way interval over seeds and "
             "problems (a random-effects ANOVA of the seed x problem table of differences, Satterthwaite degrees of "
             "freedom: it counts the problems as a sample too, so it is the one for claims about problems like "
             "these where every seed sees the same ones), the exact sign-flip test (distribution-free; it cannot go "
             "below its smallest possible p, 2 / 2^seeds); the test marked * decides, Holm-corrected over the "
             "study's family (a calibrator is tested alone; a descriptive endpoint is outside it); and a bootstrap "
             "over seeds then problems "
             f"({RESAMPLES} resamples) as a description only: with few seeds it is too sure. Detectable: the "
             "smallest true difference the t test over these seeds finds with 80 % power at the 5 % level, from "
             "the seeds' own spread.", "",
             "| " + " | ".join(SEED_LEVEL_COLUMNS) + " |", "|" + "---|" * len(SEED_LEVEL_COLUMNS)]
    if any(r.get("decides") == "sign_flip" for r in rows):
        lines[2] += (f" Rows in steps ({STEPS_SOONER}: the reference's first step at the share minus the recipe's) "
                     f"and seeds ({LEARNED}: the share of seeds whose recipe run learned and whose reference run did "
                     "not, minus the reverse) are the transition's endpoints (see 'When the runs learned'); the "
                     "sign-flip test decides them (marked *) and its p enters Holm's correction.")
    lines += ["| " + " | ".join(seed_level_cells(r)) + " |" for r in rows]
    lines.append("")
    return lines


TABLES_HEADING = "delft study, with the seed as the unit"  # marks the block in tables.txt that a rewrite replaces


def analysis_renderables(report: dict) -> list:
    """The seed-level rows and the verdicts, the endpoints by group and the pilot's runs reproduced, as rich
    renderables: the terminal's and tables.txt's view of what summary.md says in its sections on them."""
    from rich.table import Table

    rows = report.get("seed_level") or []
    extra = [*breakdown_renderables(report.get("breakdown")), *reproduction_renderables(report.get("reproduction"))]
    if not rows:
        return extra
    table = Table(title=f"{TABLES_HEADING}: recipe minus reference, points (t test over seeds, Holm over every "
                        "row; the bootstrap is descriptive)")
    for column in SEED_LEVEL_COLUMNS:
        table.add_column(column)
    for r in rows:
        table.add_row(*seed_level_cells(r))
    verdict = [line.replace("**", "") for line in verdict_lines(report.get("verdicts"))[2:] if line]
    return [table, *verdict, "", *extra]


def analysis_text(report: dict) -> str:
    """:func:`analysis_renderables` as plain text, the way tables.txt records the terminal."""
    text = tables_console()
    for item in analysis_renderables(report):
        text.print(item, highlight=False)
    return text.export_text()
