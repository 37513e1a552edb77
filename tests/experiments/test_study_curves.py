"""A study's learning curves (curve: snapshots evaluated, the area under exact match), its positive controls and
verdicts, and the written-in-advance description; a tiny from-scratch study end to end."""

import json

import pytest
from helpers import write_yaml
from rich.console import Console

from delft.errors import UserError
from delft.experiments.curves import curve_of, trapezoid
from delft.experiments.seed_level import seed_analysis, verdict_lines, verdicts
from delft.experiments.study import run_study

DESCRIPTION = "Asks whether del_prob learns faster than CE. Confirmed: +3 points on every seed, Holm p < 0.05."


def scratch_arms(tmp_path, curve=(2,), control="ntl_was", max_steps=4):
    rec = tmp_path / "rec"
    write_yaml(rec / "base.yaml", {
        "model": {"init": "scratch", "architecture": {"hidden_size": 32, "layers": 1, "heads": 2,
                                                      "intermediate_size": 64, "context": 40}},
        "data": {"synthetic": {"n": 32, "max_digits": 1, "ops": ["+"], "decimal_fraction": 0,
                               "negative_fraction": 0}, "max_length": 32, "val_size": 0},
        "train": {"finetuning": "full", "max_steps": max_steps, "batch_size": 8, "learning_rate": 1e-2,
                  "logging_steps": 1, "save_steps": 10, "warmup_ratio": 0.0, "gradient_checkpointing": False},
        "eval": {"batch_size": 8, "bootstrap": 10, "max_new_tokens": 3},
        "output": {"dir": str(tmp_path / "runs" / "base-seed0")}})
    for name, loss in (("ce", {"type": "ce"}), ("del_prob", {"type": "del_prob", "weight": 1.0}),
                       ("ntl_was", {"type": "ntl_was", "weight": 0.3})):
        write_yaml(rec / f"{name}.yaml", {"base": "base.yaml", "loss": loss,
                                          "output": {"dir": str(tmp_path / "runs" / f"{name}-seed0")}})
    recipes = ["rec/ce.yaml", "rec/del_prob.yaml", {"recipe": "rec/ntl_was.yaml", "control": True}
               if control == "ntl_was" else "rec/ntl_was.yaml"]
    if control == "ce":
        recipes[0] = {"recipe": "rec/ce.yaml", "control": True}
    return write_yaml(tmp_path / "s.study.yaml", {
        "description": DESCRIPTION, "recipes": recipes, "seeds": [0, 1], "out": str(tmp_path / "out"),
        "curve": list(curve), "evals": {"held_out": {"source": "synthetic", "limit": 8, "max_new_tokens": 3}}})


def test_a_scratch_study_with_a_curve_and_a_control(tmp_path):
    run_study(scratch_arms(tmp_path), console=Console(quiet=True))
    report = json.loads((tmp_path / "out" / "study.json").read_text())
    c = report["curves"]["held_out"]
    assert c["steps"] == [0, 2, 4] and c["reference"] == "ce"
    for name in ("ce", "del_prob", "ntl_was"):
        arm = c["recipes"][name]
        for seed in ("0", "1"):
            em = arm["exact_match"][seed]
            assert len(em) == 3 and em[0] == c["base_exact_match"]
            assert em[-1] == pytest.approx(next(m["metrics"]["exact_match"] for m in
                                                report["evals"]["held_out"]["models"]
                                                if m["recipe"] == name and m["seed"] == int(seed)))
            assert arm["auc"][seed] == pytest.approx(trapezoid(c["steps"], em))  # problem areas average to it
    rows = {(r["metric"], r["recipe"]) for r in report["seed_level"]}
    assert rows == {(m, r) for m in ("exact_match", "exact_match_auc") for r in ("del_prob", "ntl_was")}
    v = report["verdicts"]
    assert set(v["controls"]) == {"ntl_was"} and {a["recipe"] for a in v["arms"]} == {"del_prob"}
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert DESCRIPTION in summary and "## Learning curves" in summary and "## Verdicts" in summary
    assert "ntl_was (control)" in summary
    assert report["settings"]["curve"] == [2] and report["settings"]["controls"] == ["ntl_was"]
    for run in ("ce-seed0", "ntl_was-seed1"):  # the runs kept the snapshot the curve evaluated
        assert (tmp_path / "runs" / run / "snapshots" / "step-000002" / "model.safetensors").is_file()


def test_a_curve_step_at_or_after_the_end_is_refused_before_training(tmp_path):
    with pytest.raises(UserError, match="not before the end of training"):
        run_study(scratch_arms(tmp_path, curve=(2, 4)), console=Console(quiet=True))
    assert not (tmp_path / "runs").exists()


def test_the_reference_cannot_be_the_control(tmp_path):
    with pytest.raises(UserError, match="reference recipe ce is marked control"):
        run_study(scratch_arms(tmp_path, control="ce"), console=Console(quiet=True))


def test_the_area_is_the_mean_exact_match_over_training():
    assert trapezoid([0, 2, 4], [0.0, 0.5, 1.0]) == pytest.approx(0.5)
    assert trapezoid([0, 1, 4], [0.0, 1.0, 1.0]) == pytest.approx((0.5 + 3.0) / 4)

    def section(flags: dict) -> dict:
        return {"settings": {"reference": "ce"}, "models": [
            {"recipe": r, "seed": s, "predictions": [{"exact": bool(x)} for x in f]} for (r, s), f in flags.items()]}

    base = [0, 0]
    mid = section({(None, None): base, ("ce", 0): [1, 0], ("del", 0): [1, 1]})
    end = section({(None, None): base, ("ce", 0): [1, 1], ("del", 0): [1, 1]})
    c = curve_of({5: mid}, end, 10)
    assert c["steps"] == [0, 5, 10]
    assert c["recipes"]["ce"]["exact_match"][0] == [0.0, 0.5, 1.0]
    # per problem: ce [0,1,1] -> 0.75, [0,0,1] -> 0.25; del [0,1,1] twice -> 0.75
    assert c["recipes"]["ce"]["auc_per_problem"][0] == pytest.approx([0.75, 0.25])
    assert c["recipes"]["del"]["auc"][0] == pytest.approx(0.75)


def _row(recipe, per_seed, ci, holm_p, metric="exact_match", levels=(0.3, 0.35)):
    return {"set": "s", "metric": metric, "recipe": recipe, "difference": sum(per_seed) / len(per_seed),
            "t_test": {"per_seed": per_seed, "ci": ci}, "holm_p": holm_p,
            "levels": {"reference": levels[0], "recipe": levels[1]}}


UP = _row("ntl", [0.1] * 3, [0.05, 0.15], 0.01)  # a control that moved up
DOWN = _row("ntl", [-0.1] * 3, [-0.15, -0.05], 0.01)  # significant, the wrong way
STILL = _row("ntl", [0.0] * 3, [-0.01, 0.01], 0.8)


@pytest.mark.parametrize("arm,control,expected", [
    (_row("del", [0.05, 0.04, 0.06], [0.03, 0.07], 0.01), UP, "better"),
    (_row("del", [0.04, 0.02, 0.06], [0.0, 0.08], 0.01), STILL, "better"),  # significant stands on its own
    (_row("del", [-0.05, -0.06, -0.04], [-0.08, -0.02], 0.02), UP, "worse"),  # not "refuted": worse
    (_row("del", [0.01, -0.01, 0.0], [-0.02, 0.02], 0.9), UP, "equivalent"),
    (_row("del", [0.01, -0.01, 0.0], [-0.02, 0.02], 0.9), STILL, "not readable"),
    (_row("del", [0.01, -0.01, 0.0], [-0.02, 0.02], 0.9), DOWN, "not readable"),  # a control must move *up*
    (_row("del", [0.05, -0.03, 0.06], [-0.1, 0.15], 0.3), UP, "inconclusive"),
])
def test_verdicts_follow_the_stated_rules(arm, control, expected):
    v = verdicts([arm, control], ["ntl"], 3.0, True)
    assert [a["verdict"] for a in v["arms"]] == [expected]
    assert [m["moved"] for m in v["controls"]["ntl"]] == [{UP["holm_p"]: "up"}.get(control["holm_p"], "no")
                                                          if control is not DOWN else "down"]
    assert v["rules"]["margin_points"] == {"value": 3.0, "from": "study file"}


def test_a_control_moving_on_another_set_does_not_license_this_one():
    arm = {**_row("del", [0.01, -0.01, 0.0], [-0.02, 0.02], 0.9), "set": "long"}
    v = verdicts([arm, UP], ["ntl"], 3.0, False)
    assert v["arms"][0]["verdict"] == "not readable" and v["rules"]["margin_points"]["from"] == "delft's default"
    assert "margin 3 points (delft's default: the study file states none)" in "\n".join(verdict_lines(v))


def test_a_floor_is_not_read_as_no_effect():
    """A side below 2 % (not only exactly 0): the interval may sit inside the margin, but nothing could have moved.
    The scratch study's case: CE 0/600, del_prob 1/600, once read as "refuted"."""
    floor = _row("del", [0.0, 0.0033], [-0.02, 0.025], 0.5, levels=(0.0, 1 / 600))
    level = _row("del", [0.0, 0.01], [-0.01, 0.02], 0.9)
    v = verdicts([floor, level], [], 3.0, True)
    assert [a["verdict"] for a in v["arms"]] == ["not readable", "equivalent"]
    assert "floor" in v["arms"][0]["why"]
    assert "declares no control" in "\n".join(verdict_lines(v))  # an uncontrolled equivalence says so
    with_control = verdicts([level, UP], ["ntl"], 3.0, True)
    assert "declares no control" not in "\n".join(verdict_lines(with_control))


def test_verdicts_are_decided_by_the_t_test_over_seeds_not_the_bootstrap():
    """The scratch study's del_prob case: seeds that differ a lot. A bootstrap over 2 seeds is sure of an
    effect; the t test over seeds is not, so nothing is called better."""

    def model(recipe, seed, right):
        return {"recipe": recipe, "seed": seed, "predictions": [{"exact": i < right} for i in range(300)]}

    report = {"evals": {"s": {"settings": {"mode": "greedy", "reference": "ce"}, "problems": [{}] * 300,
                              "models": [model("ce", 0, 100), model("ce", 1, 60),
                                         model("del", 0, 170), model("del", 1, 70)]}}}
    rows = seed_analysis(report)
    assert rows[0]["bootstrap"]["p"] < 0.05 < rows[0]["t_test"]["p"] == rows[0]["holm_p"]
    assert verdicts(rows, [], 3.0, True)["arms"][0]["verdict"] == "inconclusive"


def test_a_missing_seed_is_an_error_not_a_dropped_row():

    def model(recipe, seed):
        return {"recipe": recipe, "seed": seed, "predictions": [{"exact": True}, {"exact": False}]}

    report = {"evals": {"s": {"settings": {"mode": "greedy", "reference": "ce"}, "problems": [{}] * 2,
                              "models": [model("ce", 0), model("ce", 1), model("del", 0)]}}}
    with pytest.raises(UserError, match=r"del has seeds \[0\] where the reference ce has \[0, 1\]"):
        seed_analysis(report)


def test_flips_count_changed_verdicts_against_the_same_seed_and_between_reference_seeds():
    from delft.experiments.seed_level import flip_lines, flips

    def model(recipe, seed, flags):
        return {"recipe": recipe, "seed": seed, "predictions": [{"exact": f} for f in flags]}

    report = {"evals": {"s": {"settings": {"mode": "greedy", "reference": "ce"}, "problems": [{}] * 4, "models": [
        model(None, None, [0, 0, 0, 0]), model("ce", 0, [1, 1, 0, 0]), model("ce", 1, [0, 1, 1, 0]),
        model("del", 0, [1, 1, 0, 1]), model("del", 1, [0, 1, 1, 0])]}}}
    rows = flips(report)
    assert rows == [{"set": "s", "reference": "ce", "n": 4, "arms": {"del": {0: 1, 1: 0}},
                     "reference_seed_pairs": {"0-1": 2}}]
    assert "| s (n=4) | del vs ce | 1, 0 | 2 (0-1) |" in flip_lines(rows)


def test_the_scale_report_reads_each_sizes_seed_level_rows(tmp_path):
    from delft.experiments.scale import parameters, write_scale_report

    arch = {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": None, "intermediate_size": 384,
            "context": 48, "tie_embeddings": True}
    def recipe(a):  # what a scratch study.json holds under settings.recipe (the parts that validate it)
        return {"model": {"init": "scratch", "architecture": a}, "train": {"finetuning": "full"},
                "data": {"max_length": 40}}

    assert parameters({"settings": {"recipe": recipe(arch)}}) == 865_920  # as torch counts

    def study(name, prefix, hidden, diff):
        row = {"set": "held_out", "recipe": f"{prefix}del_prob", "metric": "exact_match", "seeds": [0, 1],
               "difference": diff, "bootstrap": {"ci": [diff - 0.01, diff + 0.01], "p": 0.2}, "holm_p": 0.4,
               "t_test": {"per_seed": [diff - 0.01, diff + 0.01], "ci": [diff - 0.02, diff + 0.02]}}
        other = {**row, "recipe": f"{prefix}del"}
        d = tmp_path / name
        d.mkdir()
        report = {"settings": {"recipe": recipe({**arch, "hidden_size": hidden})},
                  "seed_level": [row, other]}
        (d / "study.json").write_text(json.dumps(report))
        return d

    dirs = [study("large", "large_", 256, 0.01), study("mid", "", 128, 0.03)]
    write_scale_report(dirs, "del_prob", tmp_path / "out")
    rows = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert [r["parameters"] for r in rows] == sorted(r["parameters"] for r in rows) and len(rows) == 2
    assert [round(r["difference"], 2) for r in rows] == [0.03, 0.01]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| held_out | exact_match | 865,920 | 2 | +3.0 [+1.0, +5.0] |" in summary
    assert (tmp_path / "out" / "difference_by_size.png").stat().st_size > 1000


def test_a_set_the_runs_trained_on_is_also_read_on_its_unseen_problems():
    """Runs that trained on some of a set's problems: the seed-level rows come twice, on the whole set and on the
    problems no run saw, and the verdicts read each (a control must move up on the unseen problems to license
    readings there)."""
    def model(recipe, seed, right, seen):
        return {"recipe": recipe, "seed": seed, "contamination": {"seen_in_training": len(seen), "seen_problems": seen},
                "predictions": [{"index": i, "exact": i < right} for i in range(10)]}

    seen = [0, 1, 2, 3]  # the first four problems were training problems: every run gets them right
    report = {"evals": {"s": {"settings": {"mode": "greedy", "reference": "ce"}, "problems": [{}] * 10, "models": [
        model("ce", 0, 4, seen), model("ce", 1, 5, seen), model("del", 0, 6, seen), model("del", 1, 8, seen)]}}}
    rows = seed_analysis(report)
    assert [(r["set"], r["problems"]) for r in rows] == [("s", 10), ("s (unseen)", 6)]
    assert rows[0]["levels"] == pytest.approx({"reference": 0.45, "recipe": 0.7})
    assert rows[1]["levels"] == pytest.approx({"reference": 0.5 / 6, "recipe": 3 / 6})
    assert rows[1]["t_test"]["per_seed"] == pytest.approx([2 / 6, 3 / 6])
