"""`delft study --plan`: the smallest difference each comparison can detect, from a stated or piloted spread."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import write_arms, write_yaml
from typer.testing import CliRunner

from delft.cli import app
from delft.experiments.power import (
    WORST_PROBLEM_VARIANCE,
    Unpiloted,
    comparisons,
    endpoint_floors,
    pilot_detail,
    pilot_spreads,
    plan_rows,
    two_way_detectable,
)
from delft.experiments.seed_level import seed_analysis
from delft.experiments.seed_tests import detectable_difference, spread_upper_bound, t_power


def _pilot(ref_right: list[int], arm_right: list[int], n: int = 100) -> dict:
    """A pilot study.json: per seed, the reference right on its first ref_right[s] problems, the arm on
    arm_right[s] (so each seed's paired differences are +1 on the extra problems, 0 elsewhere)."""
    def model(recipe, seed, right):
        return {"recipe": recipe, "seed": seed, "predictions": [{"exact": i < right} for i in range(n)]}

    models = [model("ce", s, r) for s, r in enumerate(ref_right)]
    models += [model("del", s, r) for s, r in enumerate(arm_right)]
    return {"evals": {"held_out": {"settings": {"mode": "greedy", "reference": "ce"}, "models": models}}}


def test_a_pilot_spread_is_the_seeds_spread_less_what_its_problems_explain():
    pilot = _pilot([30, 30, 30], [40, 30, 50])  # per seed +0.10, 0, +0.20 over 100 problems
    tau, w = pilot_spreads(pilot)[("held_out", "del")]
    diffs = [np.array([1.0] * k + [0.0] * (100 - k)) for k in (10, 0, 20)]
    w_hand = np.mean([d.var(ddof=1) for d in diffs])
    between = np.var([0.1, 0.0, 0.2], ddof=1)  # 0.01
    assert w == pytest.approx(w_hand) and tau == pytest.approx((between - w_hand / 100) ** 0.5)
    floor = _pilot([0, 0, 1], [0, 1, 0])  # the reference below 2 %: no spread to read
    assert pilot_spreads(floor) == {}


def test_a_stated_spread_plans_with_the_problems_noise_and_holms_first_step():
    rows = comparisons(["ce", "del", "ntl"], {"held_out": 300, "longer": 200}, curve=False)
    assert [(r["set"], r["recipe"]) for r in rows] == [("held_out", "del"), ("held_out", "ntl"),
                                                       ("longer", "del"), ("longer", "ntl")]
    plan = plan_rows(rows, seeds=10, margin_points=3.0, seed_spread=2.0, pilot=None)
    first = plan[0]
    sd = (0.02 ** 2 + WORST_PROBLEM_VARIANCE / 300) ** 0.5
    assert first["alpha"] == pytest.approx(0.05 / 4) and first["sd_per_seed"] == pytest.approx(sd)
    assert t_power(first["detectable"], sd, 10, 0.05 / 4) == pytest.approx(0.8, abs=1e-6)
    assert first["detectable"] == pytest.approx(detectable_difference(sd, 10, 0.05 / 4))
    assert plan[2]["detectable"] > first["detectable"]  # fewer problems, more noise per seed
    assert all(r["above_margin"] for r in plan)  # 10 seeds cannot see 3 points at this spread
    wide = plan_rows(rows, seeds=40, margin_points=10.0, seed_spread=2.0, pilot=None)
    assert not any(r["above_margin"] for r in wide)


def _study(tmp_path, tiny_model_dir, plan: dict | None):
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs")
    return write_yaml(rec / "s.study.yaml", {
        "recipes": ["ce.yaml", "del.yaml"], "seeds": [0, 1, 2], "out": str(tmp_path / "out"), "margin": 5,
        "evals": {"held_out": {"limit": 300}}, **({"plan": plan} if plan else {})})


def test_delft_study_plan_prints_and_warns_from_a_pilot(tmp_path, tiny_model_dir):
    (tmp_path / "pilot").mkdir()
    (tmp_path / "pilot" / "study.json").write_text(json.dumps(_pilot([30, 30, 30], [40, 30, 50])))
    study = _study(tmp_path, tiny_model_dir, {"pilot": "../pilot"})
    out = CliRunner().invoke(app, ["study", str(study), "--plan"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "held_out" in text and "pilot" in text and "cannot detect a difference of the margin (5 points)" in text
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # a plan trains nothing


def test_delft_study_plan_without_a_spread_is_refused(tmp_path, tiny_model_dir):
    out = CliRunner().invoke(app, ["study", str(_study(tmp_path, tiny_model_dir, None)), "--plan"])
    assert out.exit_code == 2 and "states no spread between seeds" in " ".join(out.output.split())
    missing = CliRunner().invoke(app, ["study", str(_study(tmp_path, tiny_model_dir, {"pilot": "nowhere"})),
                                       "--plan"])
    assert missing.exit_code == 2 and "is not there" in missing.output


def test_the_plan_is_printed_beside_the_results():
    from delft.experiments.power import plan_lines

    plan = plan_rows(comparisons(["ce", "del"], {"held_out": 300}, curve=False), 4, 3.0, 5.0, None)
    lines = "\n".join(plan_lines({"margin_points": 3.0, "rows": plan}))
    assert "## Power, planned before the runs" in lines
    assert "| held_out | exact | del | 4 | 300 | 5.0 | stated |" in lines
    assert plan_lines(None) == []


def test_a_pilot_plans_with_the_upper_bound_of_its_spread_and_only_for_the_arms_it_ran():
    pilot = _pilot([30, 30, 30], [40, 30, 50])
    d = pilot_detail(pilot)[("held_out", "del")]
    bound = spread_upper_bound(0.1, 3)  # the seeds' differences 0.1, 0, 0.2: sd 0.1, 3 seeds: x 6.28
    assert d["tau_upper"] == pytest.approx((bound ** 2 - d["w"] / 100) ** 0.5)
    assert d["tau_upper"] > 6 * d["tau"]
    rows = comparisons(["ce", "del", "ntl"], {"held_out": 300}, curve=False)
    with pytest.raises(Unpiloted) as missing:  # ntl did not run in the pilot: del's spread is not lent to it
        plan_rows(rows, 10, 3.0, None, pilot)
    assert missing.value.args[0] == [("held_out", "ntl")]
    both = plan_rows(rows, 10, 3.0, 2.0, pilot)  # a stated spread covers the arm the pilot lacks
    assert [r["spread_source"] for r in both] == ["pilot bound", "stated"]


def test_the_two_way_plan_counts_the_problems_that_every_seed_shares():
    rows = comparisons(["ce", "del"], {"held_out": 800}, curve=False)
    plan = plan_rows(rows, 10, 2.5, 0.5, None, decide="two_way", problem_variance=0.08)
    se = ((0.005 ** 2) / 10 + 0.08 / 800) ** 0.5  # all of w counted as the problems' (the worst case)
    assert plan[0]["se"] == pytest.approx(se)
    more_seeds = two_way_detectable(0.005, 0.08, 0.0, 40, 800, 0.05)[0]
    assert more_seeds > 0.8 * plan[0]["detectable"]  # seeds cannot average away the shared problems


def _transitions(ref_learned: int, seeds: int) -> dict:
    first = {str(s): {"first_step": 100 if s < ref_learned else None} for s in range(seeds)}
    return {"reference": "ce", "recipes": {"ce": first}}


def test_the_learned_endpoint_that_cannot_reach_the_level_is_descriptive_and_outside_holm():
    floors = endpoint_floors(["ce", "del"], 10, {"transitions": _transitions(7, 10)})
    learned = next(e for e in floors if e["metric"] == "learned")
    assert learned["smallest_p"] == pytest.approx(0.25) and learned["descriptive"]  # 3 seeds free: 2 / 2^3
    sooner = next(e for e in floors if e["metric"] == "steps_sooner")
    assert sooner["smallest_p"] == pytest.approx(2 / 1024) and not sooner["descriptive"]
    # the analysis keeps a descriptive endpoint out of Holm's family: the other row's p is not multiplied by 2
    row = {"recipe": "del", "metric": "learned", "difference": 0.3, "t_test": {"p": 0.25}, "decides": "t_test"}
    other = {"recipe": "del", "metric": "steps_sooner", "difference": 50, "t_test": {"p": 0.01}, "decides": "t_test"}
    from delft.experiments import seed_level
    rows = [dict(other), dict(row)]
    seed_level._mark_family(rows, {"plan": {"descriptive": [{"recipe": "del", "metric": "learned"}]}})
    family = [r for r in rows if r["family"] is None]
    assert [r["metric"] for r in family] == ["steps_sooner"] and rows[1]["family"] == "descriptive"


def test_delft_study_plan_states_the_floor_and_flags_a_control_that_did_not_move(tmp_path, tiny_model_dir):
    pilot = _pilot([30, 30, 30], [40, 30, 50])
    pilot["transitions"] = _transitions(2, 3)  # the reference learned on 2 of 3 pilot seeds
    pilot["seed_level"] = [{"set": "held_out", "recipe": "del", "metric": "exact_match", "difference": 0.1,
                            "holm_p": 0.4, "t_test": {"p": 0.2}, "decides": "t_test"}]
    (tmp_path / "pilot").mkdir()
    (tmp_path / "pilot" / "study.json").write_text(json.dumps(pilot))
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs")
    study = write_yaml(rec / "s.study.yaml", {
        "recipes": ["ce.yaml", {"recipe": "del.yaml", "control": True}], "seeds": list(range(10)),
        "out": str(tmp_path / "out"), "learns_at": 0.5, "plan": {"pilot": "../pilot"},
        "evals": {"held_out": {"limit": 300}}})
    out = CliRunner().invoke(app, ["study", str(study), "--plan"], terminal_width=200)
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    # 2 of 3 pilot seeds: 7 of 10 expected to learn, 3 free: 2 / 2^3 = 0.25 >= 0.05
    assert "del, learned: smallest possible p 0.25" in text and "outside Holm's family" in text
    assert "over 2 comparisons" in text  # exact match and steps sooner; learned is descriptive
    assert "Flagged: the control del: it did not move up in its pilot" in text
