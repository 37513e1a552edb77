"""A study's secondary endpoints by group: descriptive, no test decides them; they show where a difference sits.

On every greedy set, each recipe's exact match, tolerance match, log-MAE, digit accuracy over all places and
per-place digit accuracy on the problems of each group, averaged over the recipe's seeds (each seed's value on the
group, then their mean), and each recipe's difference from the reference there. Two groupings: the gold answer's
digit count (its digits as written, sign dropped, integer and fraction digits alike: "-2.06" has 3) and the
problem's operation (+ - * /), read from its stored text in delft's synthetic forms ("What is a op b?", "a op b=":
delft.evaluation.contamination.problem_mix, the parser the set's mix is counted with; other text is 'other').

Everything comes from study.json alone: each stored prediction becomes a Scored answer carrying the study's own
verdicts (exact, tolerance, each place) and its extracted number, and delft.evaluation.metrics.summarize computes
the metrics from those, as for the whole set, so a group's numbers are the set's numbers restricted to it.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Optional

from delft.evaluation.contamination import problem_mix
from delft.evaluation.metrics import DIGIT_ACCURACY, EXACT_MATCH, LOG_MAE, TOLERANCE_MATCH, place_order, summarize
from delft.numbers.answers import Extraction, Scored
from delft.numbers.digits import digits_by_place, place_name
from delft.outputs import num, pct, plain_table

BREAKDOWN_HEADING = "delft study, by group (descriptive)"  # starts the block in tables.txt (a rewrite replaces it)
ENDPOINTS = (EXACT_MATCH, TOLERANCE_MATCH, LOG_MAE, DIGIT_ACCURACY)
GROUPINGS = {"digits": "the gold answer's digit count", "operation": "operation"}
OPERATIONS = ("+", "-", "*", "/")
OTHER = "other"  # a problem whose text is not one of delft's synthetic forms


def stored_scored(pred: dict) -> Scored:
    """One stored prediction (study.json) as the Scored answer it was: the study's verdicts, its number."""
    gold = pred["gold"]
    places = {p: bool(pred["places"][place_name(p)]) for p in digits_by_place(gold)}
    value = None if pred.get("extracted") is None else Decimal(pred["extracted"])
    return Scored(Decimal(gold), Extraction(value, pred.get("rule") or "none", pred.get("matched_text")),
                  bool(pred["exact"]), bool(pred["tolerance"]), places)


def operation(question: str) -> str:
    """The operation a problem asks (+ - * /), or 'other' where its text is not delft's synthetic form."""
    return next(iter(problem_mix([question])["ops"]))


def breakdown(report: dict) -> list[dict]:
    """Per greedy set of a study report: every recipe's seed-mean endpoints by group and its difference from the
    reference per group (what study.json keeps under 'breakdown')."""
    return [set_breakdown(key, sec) for key, sec in report["evals"].items() if sec["settings"]["mode"] == "greedy"]


def set_breakdown(key: str, sec: dict) -> dict:
    """One greedy set's groups under each grouping."""
    ref = sec["settings"]["reference"]
    runs: dict[str, list[dict[int, Scored]]] = {}  # recipe -> per seed, problem index -> its answer
    for m in sec["models"]:
        if m.get("recipe") is not None:
            runs.setdefault(m["recipe"], []).append({p["index"]: stored_scored(p) for p in m["predictions"]})
    recipes = [ref] + [r for r in runs if r != ref]
    labels = {"digits": {p["index"]: str(len(digits_by_place(p["gold"]))) for p in sec["problems"]},
              "operation": {p["index"]: operation(p.get("question") or "") for p in sec["problems"]}}
    if set(labels["operation"].values()) == {OTHER}:  # no problem in delft's synthetic form: one group, no breakdown
        del labels["operation"]
    return {"set": key, "reference": ref, "recipes": recipes, "seeds": {r: len(runs[r]) for r in recipes},
            "groupings": {g: groups(label_of, runs, recipes, ref) for g, label_of in labels.items()}}


def _order(labels: set[str]) -> list[str]:
    """Digit counts from the fewest up; operations in + - * / order, then 'other'."""
    if labels <= set(OPERATIONS) | {OTHER}:
        return [x for x in (*OPERATIONS, OTHER) if x in labels]
    return sorted(labels, key=int)


def groups(label_of: dict[int, str], runs: dict[str, list[dict[int, Scored]]], recipes: list[str],
           ref: str) -> list[dict]:
    """Per group (in _order): its problems, each recipe's seed mean there and each arm's difference from ``ref``."""
    out = []
    for label in _order(set(label_of.values())):
        members = [i for i, x in label_of.items() if x == label]
        means = {r: seed_mean([summarize([by_index[i] for i in members], 0) for by_index in runs[r]])
                 for r in recipes}
        out.append({"group": label, "n": len(members), "recipes": means,
                    "vs_reference": {r: minus(means[r], means[ref]) for r in recipes if r != ref}})
    return out


def _mean(values: list[Optional[float]]) -> Optional[float]:
    """The mean over the seeds that have a value (a seed with no number in a group has no log-MAE there)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def seed_mean(per_seed: list[dict]) -> dict:
    """Each endpoint's mean over one recipe's seeds (summaries of the same problems), per place too."""
    places = per_seed[0]["per_place"]  # the places of the gold answers: the same for every seed
    return {**{m.key: _mean([s[m.key] for s in per_seed]) for m in ENDPOINTS},
            "per_place": {name: {"place": p["place"], "n": p["n"],
                                 "accuracy": _mean([s["per_place"][name]["accuracy"] for s in per_seed])}
                          for name, p in places.items()}}


def _difference(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def minus(arm: dict, ref: dict) -> dict:
    """``arm`` minus ``ref`` in every endpoint and place."""
    return {**{m.key: _difference(arm[m.key], ref[m.key]) for m in ENDPOINTS},
            "per_place": {name: _difference(p["accuracy"], ref["per_place"][name]["accuracy"])
                          for name, p in arm["per_place"].items()}}


def _value(x: Optional[float], rate: bool) -> str:
    return pct(x, unit="") if rate else num(x, ".3f")


def _signed(x: Optional[float], rate: bool) -> str:
    if x is None:
        return "-"
    text = f"{100 * x:+.1f}" if rate else f"{x:+.3f}"
    return text.replace("-", "+") if float(text) == 0 else text  # a rounding residue is no loss: no "-0.0"


def _cells(means: dict, diffs: dict, recipes: list[str], get, rate: bool) -> list[str]:
    """The reference's value, then each arm's value and its difference from the reference."""
    cells = [_value(get(means[recipes[0]]), rate)]
    for r in recipes[1:]:
        cells += [_value(get(means[r]), rate), _signed(get(diffs[r]), rate)]
    return cells


def breakdown_tables(b: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """One set's tables as (title, header, rows): per grouping, the endpoints, then per-place digit accuracy."""
    recipes, ref = b["recipes"], b["reference"]
    arms = [c for r in recipes[1:] for c in (r, f"{r} - {ref}")]
    tables = []
    for grouping, label in ((g, x) for g, x in GROUPINGS.items() if g in b["groupings"]):
        ends, places = [], []
        for g in b["groupings"][grouping]:
            means, diffs = g["recipes"], g["vs_reference"]
            for m in ENDPOINTS:
                ends.append([g["group"], str(g["n"]), m.name + (" %" if m.rate else ""),
                             *_cells(means, diffs, recipes, lambda x, k=m.key: x[k], m.rate)])
            first = means[ref]["per_place"]
            for name in [place_name(p) for p in place_order(v["place"] for v in first.values())]:
                places.append([g["group"], name, str(first[name]["n"]),
                               *_cells(means, diffs, recipes, lambda x, k=name: _place(x, k), True)])
        tables.append((f"{b['set']} by {label}", [grouping, "n", "metric", ref, *arms], ends))
        tables.append((f"{b['set']} by {label}: per-place digit accuracy, %", [grouping, "place", "n", ref, *arms],
                       places))
    return tables


def _place(x: dict, name: str) -> Optional[float]:
    """A place's accuracy in a recipe's mean (a dict with 'accuracy') or its difference (a number)."""
    value = x["per_place"].get(name)
    return value["accuracy"] if isinstance(value, dict) else value


INTRO = ("Each recipe's mean over its seeds on the problems of each group, and its difference from the reference "
         "(points; log-MAE in log10 units, lower is better). No test decides these: they describe where a "
         "difference sits, on groups far smaller than the set. Digit count: the gold answer's digits as written "
         "(sign dropped, integer and fraction digits alike); operation: read from the problem's text (delft's "
         "synthetic forms; any other is 'other'). n: problems in the group (per place: those whose gold answer has "
         "that place).")


def breakdown_lines(rows: Optional[list[dict]]) -> list[str]:
    """The summary's section on :func:`breakdown`."""
    if not rows:
        return []
    lines = ["## By the gold answer's digit count and by operation (descriptive)", "", INTRO, ""]
    for b in rows:
        for title, header, body in breakdown_tables(b):
            lines += [f"#### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(r) + " |" for r in body] + [""]
    return lines


def breakdown_renderables(rows: Optional[list[dict]]) -> list:
    """:func:`breakdown` as rich tables for the terminal and tables.txt, after a heading line of their own."""
    if not rows:
        return []
    out: list = [f"{BREAKDOWN_HEADING}: recipe means over seeds by group, and each arm minus the reference"]
    for b in rows:
        for title, header, body in breakdown_tables(b):
            out.append(plain_table(header, body, title))
    return out + [""]
