"""`delft study --plan`: the smallest difference each comparison can detect, from a stated or piloted spread."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import write_arms, write_yaml
from typer.testing import CliRunner

from delft.cli import app
from delft.experiments.power import WORST_PROBLEM_VARIANCE, comparisons, pilot_spreads, plan_rows
from delft.experiments.seed_tests import detectable_difference, t_power


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
