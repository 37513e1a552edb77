"""When each run learns (a study's learns_at): the first step at the share, read from the runs' own held-out
measurements, the two endpoints against the reference decided by the exact sign-flip test, and a tiny scratch
study end to end."""

import json

import pytest
import yaml
from helpers import write_yaml
from rich.console import Console
from test_study_curves import scratch_arms

from delft.errors import UserError
from delft.experiments.seed_level import seed_analysis, seed_level_cells, verdicts
from delft.experiments.study import plan_study, run_study
from delft.experiments.transitions import (
    LEARNED,
    STEPS_SOONER,
    first_pass,
    heldout_curve,
    run_transitions,
    transition_lines,
    transition_rows,
)


def fake_run(path, exact_by_step):
    """A run directory whose metrics.jsonl holds training rows and held-out rows as delft writes them."""
    path.mkdir(parents=True)
    rows = []
    for step, exact in exact_by_step.items():
        rows.append({"step": step, "loss": 1.0, "ce": 1.0})
        rows.append({"step": step, "accuracy": exact, "digit_accuracy": exact, "accuracy_n": 10})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 9, \"accur")
    return path


def test_the_first_step_at_the_share():
    curve = [(100, 0.1), (200, 0.49), (300, 0.5), (400, 0.2)]
    assert first_pass(curve, 0.5) == 300  # the first measurement at or above, even if it falls back later
    assert first_pass(curve, 0.6) is None


def test_the_curve_is_read_from_metrics_jsonl_and_a_resumed_step_counts_once(tmp_path):
    run = fake_run(tmp_path / "r", {100: 0.2, 200: 0.6})
    with (run / "metrics.jsonl").open("a") as f:  # a resume rewrote step 200 (a cut line above is skipped)
        f.write("\n" + json.dumps({"step": 200, "accuracy": 0.4}) + "\n")
    assert heldout_curve(run) == [(100, 0.2), (200, 0.4)]


# Hand-worked: 4 seeds; the reference learns at 300, never, 500, 200; the arm at 200, 400, never, 200.
# With never = 600 (last step 500 + 100): steps sooner = 300-200, 600-400, 500-600, 200-200 = 100, 200, -100, 0.
REF = {0: {100: 0.1, 300: 0.5, 500: 0.9}, 1: {100: 0.0, 500: 0.3}, 2: {500: 0.5}, 3: {200: 0.7, 500: 0.8}}
ARM = {0: {200: 0.6, 500: 0.9}, 1: {400: 0.55, 500: 0.6}, 2: {500: 0.1}, 3: {200: 0.5, 500: 0.7}}


def hand_worked(tmp_path) -> dict:
    runs = {}
    for name, table in (("ce", REF), ("del", ARM)):
        for seed, curve in table.items():
            runs[(name, seed)] = fake_run(tmp_path / f"{name}-seed{seed}", curve)
    return run_transitions(runs, "ce", 0.5, 100, 10)


def test_steps_sooner_and_learned_on_a_hand_worked_case(tmp_path):
    record = hand_worked(tmp_path)
    assert record["censored_at"] == 600
    assert [record["recipes"]["ce"][s]["first_step"] for s in range(4)] == [300, None, 500, 200]
    sooner, learned = transition_rows(record, [0, 1, 2, 3])
    assert sooner["metric"] == STEPS_SOONER and sooner["t_test"]["per_seed"] == [100, 200, -100, 0]
    assert sooner["difference"] == pytest.approx(50)
    # the exact sign-flip test by hand: of the 8 sums +-100 +-200 +-100 (the 0 only doubles each), 6 have
    # |sum| >= 200 (all but the two that cancel to 0): p = 6 / 8
    assert sooner["sign_flip"]["p"] == pytest.approx(0.75)
    assert learned["metric"] == LEARNED and learned["t_test"]["per_seed"] == [0, 1, -1, 0]
    assert learned["difference"] == 0 and learned["levels"] == {"reference": 0.75, "recipe": 0.75}
    assert sooner["decides"] == learned["decides"] == "sign_flip" and sooner["bootstrap"] is None


def test_the_rows_join_holm_with_the_sign_flip_p_and_read_in_their_units(tmp_path):
    report = {"evals": {}, "transitions": hand_worked(tmp_path)}
    rows = seed_analysis(report)
    assert [r["metric"] for r in rows] == [STEPS_SOONER, LEARNED]
    assert rows[0]["holm_p"] == pytest.approx(min(1.0, 2 * min(r["sign_flip"]["p"] for r in rows)))
    cells = seed_level_cells(rows[0])
    assert cells[1] == "steps_sooner (steps)" and cells[3] == "+50" and cells[4] == "+100, +200, -100, +0"
    assert cells[9].endswith("*") and cells[10] == "-" and cells[7] == "-"  # no problems: no two-way interval
    v = verdicts(rows, [], 3.0, True)
    assert {a["verdict"] for a in v["arms"]} == {"inconclusive"}  # no margin of equivalence for steps or seeds


def test_an_arm_that_learns_on_every_seed_where_the_reference_never_does_is_better(tmp_path):
    runs = {}
    for seed in range(7):  # 6 would not do: Holm doubles the floor 2 / 64 past 0.05
        runs[("ce", seed)] = fake_run(tmp_path / f"ce-{seed}", {100: 0.1, 200: 0.2})
        runs[("ntl", seed)] = fake_run(tmp_path / f"ntl-{seed}", {100: 0.3, 200: 0.8})
    rows = seed_analysis({"evals": {}, "transitions": run_transitions(runs, "ce", 0.5, 100, 10)})
    assert all(r["sign_flip"]["p"] == pytest.approx(2 / 128) for r in rows)  # the floor with 7 seeds
    assert [r["difference"] for r in rows] == [100, 1.0]  # 300 (never) - 200; 7 of 7 seeds won
    labels = {a["metric"]: a["verdict"] for a in verdicts(rows, [], 3.0, True)["arms"]}
    assert labels == {STEPS_SOONER: "better", LEARNED: "better"}


def test_no_run_that_learned_is_not_readable(tmp_path):
    runs = {(n, s): fake_run(tmp_path / f"{n}-{s}", {100: 0.1}) for n in ("ce", "del") for s in (0, 1)}
    rows = seed_analysis({"evals": {}, "transitions": run_transitions(runs, "ce", 0.5, 100, 10)})
    assert {a["verdict"] for a in verdicts(rows, [], 3.0, True)["arms"]} == {"not readable"}


def test_a_missing_seed_is_an_error(tmp_path):
    record = hand_worked(tmp_path)
    del record["recipes"]["del"][3]
    with pytest.raises(UserError, match="seed"):
        seed_analysis({"evals": {}, "transitions": record})


def test_a_study_with_learns_at_needs_measurements_before_training(tmp_path):
    path = scratch_arms(tmp_path, curve=())
    spec = yaml.safe_load(path.read_text())
    write_yaml(path, {**spec, "learns_at": 0.5})
    with pytest.raises(UserError, match="accuracy_steps is 0"):
        run_study(path, console=Console(quiet=True))
    assert not (tmp_path / "runs").exists()


def test_a_scratch_study_dates_each_run(tmp_path):
    path = scratch_arms(tmp_path, curve=())
    spec = yaml.safe_load(path.read_text())
    write_yaml(path, {**spec, "learns_at": 0.25})
    base = tmp_path / "rec" / "base.yaml"
    recipe = yaml.safe_load(base.read_text())
    recipe["train"].update({"accuracy_steps": 2, "accuracy_examples": 8})
    write_yaml(base, recipe)
    run_study(path, console=Console(quiet=True))
    report = json.loads((tmp_path / "out" / "study.json").read_text())
    t = report["transitions"]
    assert t["reference"] == "ce" and t["censored_at"] == 6 and report["settings"]["learns_at"] == 0.25
    for (name, seed), run in {(n, s): tmp_path / "runs" / f"{n}-seed{s}" for n in ("ce", "del_prob", "ntl_was")
                              for s in (0, 1)}.items():
        rec = t["recipes"][name][str(seed)]
        assert list(zip(rec["steps"], rec["exact"])) == heldout_curve(run) and rec["steps"] == [2, 4]
    assert {(r["metric"], r["recipe"]) for r in report["seed_level"] if r.get("unit")} == {
        (m, r) for m in (STEPS_SOONER, LEARNED) for r in ("del_prob", "ntl_was")}
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## When the runs learned" in summary and "\n".join(transition_lines(t)) in summary


def test_the_plan_counts_the_endpoints_in_holms_family(tmp_path):
    path = scratch_arms(tmp_path, curve=())
    spec = yaml.safe_load(path.read_text())
    write_yaml(path, {**spec, "learns_at": 0.5, "seeds": list(range(10)), "plan": {"seed_spread": 5.0}})
    base = tmp_path / "rec" / "base.yaml"
    write_yaml(base, {**(b := yaml.safe_load(base.read_text())), "train": {**b["train"], "accuracy_steps": 2}})
    console = Console(record=True, width=200)
    plan = plan_study(path, console=console)
    assert len(plan["rows"]) == 2 and len(plan["endpoints"]) == 4  # 2 recipes x (steps sooner, learned)
    assert plan["family"] == 6 and plan["rows"][0]["alpha"] == pytest.approx(0.05 / 6)
    assert all(e["smallest_p"] == pytest.approx(2 / 1024) and not e["descriptive"] for e in plan["endpoints"])
    text = " ".join(console.export_text().split())
    assert "smallest possible p 0.00195" in text and "over 6 comparisons" in text
