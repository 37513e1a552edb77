"""The metric table (delft.evaluation.metrics.METRICS) drives every reader of the answer metrics: delft eval's
table, compare's and study's summaries, the model card, the held-out accuracy while training; and no module
outside the table spells a metric's key, so a new metric is its value, its summary and one row."""

import ast
import json
import random
import re
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

import delft.training.heldout as heldout
from delft.evaluation.metrics import (
    COLUMNS,
    EXACT_MATCH,
    HEADLINE,
    METRICS,
    PAIRED,
    SAMPLING,
    differences,
    flags,
    metric_value,
    summarize,
)
from delft.evaluation.report import render_table
from delft.evaluation.results import ModelResult
from delft.evaluation.sampling import summarize_samples
from delft.experiments.results import markdown_set, mean_over_seeds
from delft.experiments.summary import headline
from delft.export.report import ExportResult, eval_headline, model_card
from delft.numbers.answers import extract_answer, score
from delft.numbers.harness import harness_scores
from delft.training.heldout import HeldOut

REPO = Path(__file__).resolve().parents[2]
GOLDS = [Decimal(random.Random(0).randint(1, 9999)) / (10 if i % 3 == 0 else 1) for i in range(20)]
SAMPLES = 3


def scored(seed: int) -> list:
    """Answers to GOLDS, some right, some off, some without a number; harness flags and a task score each."""
    rng = random.Random(seed)
    out = []
    for gold in GOLDS:
        value = gold if rng.random() > 0.5 else gold + rng.randint(-20, 20)
        text = f"The answer is #### {value}" if rng.random() > 0.1 else "no idea"
        s = score(extract_answer(text), gold, harness_scores(text, str(gold)))
        s.task_score = rng.random()
        out.append(s)
    return out


def sampled_result(name: str, seed: int) -> ModelResult:
    """A sampled model (SAMPLES answers per problem), so that every row of the table has a value."""
    samples = [list(group) for group in zip(*(scored(seed * 10 + i) for i in range(SAMPLES)))]
    r = ModelResult(name, None, scored=[g[0] for g in samples], samples=samples)
    r.metrics = {**summarize(r.scored, 50, 0), SAMPLING: summarize_samples(samples, 50, 0)}
    return r


def test_every_row_is_a_row_of_delft_evals_table_in_the_tables_order():
    results = [sampled_result("base", 1), sampled_result("run", 2)]
    console = Console(width=240, record=True, file=open("/dev/null", "w"))
    console.print(render_table(results, "t", harness=True))
    lines = console.export_text().splitlines()
    found = []
    for m in METRICS:
        label = m.label.format(k=SAMPLES)
        at = next(i for i, line in enumerate(lines) if f"│ {label} " in line or f"{SAMPLES} {label} " in line)
        found.append(at)
        assert metric_value(results[0].metrics, m) is not None, m.key
    assert found == sorted(found)
    greedy = [ModelResult(r.name, None, metrics={k: v for k, v in r.metrics.items() if k != SAMPLING})
              for r in results]
    console = Console(width=240, record=True, file=open("/dev/null", "w"))
    console.print(render_table(greedy, "t"))
    text = console.export_text()
    for m in METRICS:  # the rows delft eval shows only with samples or --harness are gone without them
        assert (m.label.format(k=SAMPLES) in text) == (m.only not in ("sampled", "harness")), m.key


def test_the_model_card_shows_every_headline_row_in_its_format(tmp_path):
    metrics = summarize(scored(1), 50, 0)
    (tmp_path / "eval.json").write_text(json.dumps({"models": [{"name": "base", "metrics": metrics}]}))
    evals = eval_headline(tmp_path)
    card = model_card(ExportResult(str(tmp_path / "out"), str(tmp_path), "base-model", "16-bit", "merged",
                                   "bfloat16"), {}, None, evals, tmp_path)
    for m in METRICS:  # "KEY VALUE" in the row's format, for the headline rows and no others
        value = metric_value(metrics, m)
        shown = m.key if value is None else f"{m.key} {value:.1%}" if m.rate else f"{m.key} {value:g}"
        assert bool(re.search(rf"[\s,]{re.escape(shown)}(,|$)", card, re.M)) == m.headline, m.key


def greedy_section(lists: list) -> dict:
    """A greedy set of compare's or study's report: the base, the reference and one arm, seed 0."""
    d = differences(flags(lists[0]), flags(lists[1]), 50)
    return {"settings": {"n": len(GOLDS), "source": "synthetic", "data": {"synthetic": {"seed": 3}},
                         "max_new_tokens": 16, "mode": "greedy", "reference": "ce"},
            "models": [{"name": "base", "recipe": None, "seed": None, "metrics": summarize(lists[2], 50, 0),
                        "vs_reference": None},
                       {"name": "ce-seed0", "recipe": "ce", "seed": 0, "metrics": summarize(lists[0], 50, 0),
                        "vs_reference": None},
                       {"name": "del-seed0", "recipe": "del", "seed": 0, "metrics": summarize(lists[1], 50, 0),
                        "vs_reference": d}],
            "means": []}


def test_compare_and_study_summaries_carry_every_row():
    lists = [scored(seed) for seed in (1, 2, 3)]
    mean = mean_over_seeds(lists, 50, 0)
    assert {m.key for m in METRICS if not m.block} <= set(mean)
    assert all(mean[f"{m.key}_ci"] for m in METRICS if m.interval and not m.block)
    assert list(mean["per_seed"]) == [m.key for m in HEADLINE]
    assert list(differences(flags(lists[0]), flags(lists[1]), 50)) == [m.key for m in PAIRED]
    header = "\n".join(markdown_set("synthetic", greedy_section(lists), "ce")).splitlines()[2]
    at = [header.index(f"| {m.name} ") for m in COLUMNS]
    assert at == sorted(at)
    study = "\n".join(headline("synthetic", greedy_section(lists), [0]))
    assert all(f"| {m.name}, points |" in study for m in PAIRED)


def test_the_held_out_row_holds_every_row_with_a_held_out_name(monkeypatch):
    answers = [SimpleNamespace(text=f"#### {g}") for g in GOLDS]
    monkeypatch.setattr(heldout, "greedy", lambda *args, **kwargs: answers)
    problems = [SimpleNamespace(gold=g) for g in GOLDS]
    model = SimpleNamespace(training=False, config=SimpleNamespace(use_cache=False), eval=lambda: None,
                            train=lambda: None, named_modules=lambda: iter(()))  # no layers: no nf4 to check
    row = HeldOut(problems, [""] * len(GOLDS), False, [], None, 8, 2).measure(model)
    assert list(row) == [m.heldout for m in METRICS if m.heldout] + ["accuracy_n"]
    assert row[EXACT_MATCH.heldout] == 1.0 and row["accuracy_n"] == len(GOLDS)


# Spellings of a metric key outside delft/evaluation/metrics.py that stay, and why: (file, key) -> how many.
SHARED_SPELLING = {
    # ARGMAX_ACCURACY: the teacher-forced argmax digit accuracy, a measure of its own that its JSON block
    # spells like the answers' digit accuracy (teacher_forced's own vocabulary, defined there once).
    ("delft/evaluation/teacher_forced.py", "digit_accuracy"): 1,
}


def test_no_module_but_the_table_spells_a_metric_key():
    keys = {m.key for m in METRICS}
    found = []
    for path in sorted([*(REPO / "delft").rglob("*.py"), *(REPO / "bench").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel == "delft/evaluation/metrics.py":
            continue
        source = path.read_text()
        spelled: dict[str, list[int]] = {}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys:
                spelled.setdefault(node.value, []).append(node.lineno)
        for key, lines in spelled.items():
            allowed = SHARED_SPELLING.get((rel, key), 0)
            if len(lines) > allowed:
                found.append(f"{rel}:{','.join(map(str, sorted(lines)))} spells {key!r}")
    assert not found, ("read the metric from delft.evaluation.metrics (its row's key, or METRICS) instead: "
                       + "; ".join(found))
