"""compare and study say their size up front (runs, steps left, sets), compare --plan is a dry run beside study's,
study --plan takes the study's own stored results as its pilot when no spread is stated (and says so), and --set
on study reaches the study file's keys (issue 52 items 3 and 5). Real recipes, the tiny model, real run folders."""

from __future__ import annotations

import shutil

import yaml
from helpers import REPO, run_cli, write_arms, write_yaml
from rich.console import Console

from delft.experiments.compare import plan_compare, run_compare
from delft.experiments.study import plan_study, run_study

ARITHMETIC = REPO / "recipes" / "study" / "arithmetic.study.yaml"
STORED = REPO / "results" / "study" / "arithmetic" / "study.json"


def quiet() -> Console:
    return Console(width=200, record=True)


def said(console: Console) -> str:
    return " ".join(console.export_text().split())


def tiny_arms(tmp_path, tiny_model_dir):
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs", eval={"limit": 3, "max_new_tokens": 3,
                                                                                    "bootstrap": 10})
    study = write_yaml(rec / "tiny.study.yaml", {"recipes": ["ce.yaml", "del.yaml"], "seeds": [0], "out":
                       str(tmp_path / "out"), "evals": {"held_out": {"limit": 3, "max_new_tokens": 3}}})
    return rec, study


def test_compare_plan_trains_nothing_and_both_commands_say_their_size_first(tmp_path, tiny_model_dir):
    rec, study = tiny_arms(tmp_path, tiny_model_dir)
    arms = [rec / "ce.yaml", rec / "del.yaml"]
    console = quiet()
    planned = plan_compare(arms, [0, 1], console=console)
    text = said(console)
    assert [(r.name, r.state, r.left) for r in planned] == [("ce-seed0", "train", 2), ("del-seed0", "train", 2),
                                                             ("ce-seed1", "train", 2), ("del-seed1", "train", 2)]
    assert "4 runs (2 recipes x 2 seeds); 4 to train or resume: 8 steps" in text, text
    assert "held-out synthetic set (3 problems)" in text and "nothing was trained" in text, text
    assert not (tmp_path / "runs").exists()

    console = quiet()
    run_study(study, console=console, train_only=True)  # trains ce-seed0 and del-seed0
    text = said(console)
    up_front = "delft study: 2 runs (2 recipes x 1 seed); 2 to train or resume: 4 steps"
    assert up_front in text and text.index(up_front) < text.index("ce-seed0: training"), text

    r = run_cli("compare", *arms, "--seed", 0, "--seed", 1, "--plan")
    shown = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "finished at step 2, reused" in shown and "2 to train or resume: 4 steps; 2 finished, reused" in shown, shown
    assert not (tmp_path / "runs" / "ce-seed1").exists()

    console = quiet()
    run_compare(arms, [0], out=tmp_path / "cmp", console=console)
    text = said(console)
    assert "delft compare: 2 runs (2 recipes x 1 seed); nothing to train; 2 finished, reused" in text, text


def stored_copy(tmp_path) -> tuple:
    """The README's headline study, its results folder moved to tmp_path (only its study.json)."""
    data = yaml.safe_load(ARITHMETIC.read_text())
    data["recipes"] = [str(ARITHMETIC.parent / r) for r in data["recipes"]]
    data["out"] = str(tmp_path / "out")
    return write_yaml(tmp_path / "arithmetic.study.yaml", data), tmp_path / "out"


def test_study_plan_takes_its_own_stored_results_as_the_pilot(tmp_path):
    study, out = stored_copy(tmp_path)
    r = run_cli("study", study, "--plan")
    assert r.exit_code == 2 and "run the study once" in " ".join(r.output.split()), r.output  # no results yet
    out.mkdir()
    shutil.copy(STORED, out / "study.json")
    console = quiet()
    plan = plan_study(study, console=console)
    shown = said(console)
    assert f"its own results {out / 'study.json'} serve as the pilot" in shown, shown
    assert "15 runs (5 recipes x 3 seeds); 15 to train or resume: 2,250 steps" in shown, shown
    assert [(r["set"], r["recipe"], r["spread_source"]) for r in plan["rows"]] == [
        ("held_out", name, "pilot bound") for name in ("del", "del_ref", "del_prob", "ntl_was")]
    assert {f["set"] for f in plan["floored"]} == {"long"} and "on long a side sat on the floor" in shown, shown
    assert run_cli("study", study, "--plan").exit_code == 0


def test_set_on_study_reaches_the_study_file(tmp_path):
    study, out = stored_copy(tmp_path)
    out.mkdir()
    shutil.copy(STORED, out / "study.json")
    r = run_cli("study", study, "--plan", "--set", "seeds=[0,1]", "--set", "margin=5", "--set", "train.max_steps=20")
    shown = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "10 runs (5 recipes x 2 seeds); 10 to train or resume: 200 steps" in shown, shown
    assert "--plan: 2 seeds" in shown and "margin (5 points)" in shown, shown
    r = run_cli("study", study, "--plan", "--set", "seeds=oops")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "(with --set overrides)" in r.output and "seeds" in r.output, r.output
