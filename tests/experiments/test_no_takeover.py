"""compare and study never take over what they did not make: a user's interrupted `delft train` in a run's place,
earlier results in ``out`` (without --force), a run directory as ``out``; repeated seeds are refused."""

import json

import pytest
from helpers import interrupt_on_step, run_cli, write_arms, write_yaml

from delft.rundir import LOSS_CURVE, checkpoints, read_info


@pytest.fixture
def arms(tmp_path, tiny_model_dir):
    """(recipes dir, study file): ce and del, differing only in their loss, run in tmp_path/runs/<name>-seed<N>,
    and a one-seed study of them with one small greedy set, writing into tmp_path/out."""
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs", eval={"limit": 2, "max_new_tokens": 2})
    study = write_yaml(rec / "tiny.study.yaml", {"recipes": ["ce.yaml", "del.yaml"], "seeds": [0],
                                                 "out": str(tmp_path / "out"),
                                                 "evals": {"held_out": {"limit": 2, "max_new_tokens": 2}}})
    return rec, study


def interrupted_train(monkeypatch, recipe, at_call: int, *sets: str):
    """`delft train RECIPE --set ...` as a user runs it, Ctrl-C'd in its ``at_call``-th optimizer step."""
    restore = interrupt_on_step(monkeypatch, at_call)
    try:
        result = run_cli("train", recipe, *[x for s in sets for x in ("--set", s)])
    finally:
        restore()
    assert result.exit_code == 130, result.output


def test_a_study_does_not_take_over_an_interrupted_plain_run(tmp_path, arms, monkeypatch):
    rec, study = arms
    run = tmp_path / "runs" / "ce-seed0"  # the study's ce arm, seed 0
    interrupted_train(monkeypatch, rec / "ce.yaml", 5, "train.max_steps=8")  # stopped at step 4 of its 8
    kept = [c.name for c in checkpoints(run)]
    assert kept == ["step-000004"]

    r = run_cli("study", study)
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert str(run) in said and "an interrupted run of a different recipe" in said
    assert "train.max_steps: 8 there, 2 here" in said and "Traceback" not in said
    assert [c.name for c in checkpoints(run)] == kept and read_info(run)["status"] == "interrupted"
    assert read_info(run)["total_steps"] == 8
    assert not (tmp_path / "runs" / "del-seed0").exists() and not (tmp_path / "out").exists()  # refused first


def test_compare_does_not_take_over_an_interrupted_plain_run(tmp_path, arms, monkeypatch):
    rec, _ = arms
    run = tmp_path / "runs" / "ce-seed0"
    interrupted_train(monkeypatch, rec / "ce.yaml", 2, "train.max_steps=8")  # step 1 of 8: compare would go to 2
    r = run_cli("compare", rec / "ce.yaml", rec / "del.yaml", "--no-transfer", "--out", tmp_path / "out")
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert str(run) in said and "train.max_steps: 8 there, 2 here" in said
    assert [c.name for c in checkpoints(run)] == ["step-000001"] and read_info(run)["status"] == "interrupted"

    # the user's own resume, with the compare's steps (at least the checkpoint's): then compare reuses it, as it
    # does a run that differs only in bookkeeping (logging_steps)
    assert run_cli("train", rec / "ce.yaml", "--set", "train.logging_steps=2").exit_code == 0
    assert read_info(run)["status"] == "completed" and read_info(run)["step"] == 2
    r = run_cli("compare", rec / "ce.yaml", rec / "del.yaml", "--no-transfer", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    training = json.loads((tmp_path / "out" / "compare.json").read_text())["training"]
    assert training["ce-seed0"]["status"] == "reused" and training["del-seed0"]["status"] == "trained"


def test_a_second_study_never_replaces_or_mixes_with_the_first(tmp_path, arms):
    rec, study = arms
    out = tmp_path / "out"
    assert run_cli("study", study).exit_code == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"study.json", "summary.md", "tables.txt", "held_out.png"}
    (out / "notes.md").write_text("mine")  # a file the study did not write
    second = write_yaml(rec / "second.study.yaml", {"recipes": ["ce.yaml", "del.yaml"], "seeds": [1], "out": str(out),
                                                    "evals": {"other": {"limit": 2, "max_new_tokens": 2}}})

    r = run_cli("study", second)
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{out} already holds results (study.json, summary.md, tables.txt, held_out.png)" in said
    assert "--force" in said
    assert not (tmp_path / "runs" / "ce-seed1").exists()  # refused before any training
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "notes.md"} == first

    assert run_cli("study", second, "--force").exit_code == 0
    assert {p.name for p in out.iterdir()} == {"study.json", "summary.md", "tables.txt", "other.png", "notes.md"}
    assert (out / "notes.md").read_text() == "mine"  # kept: not the study's
    report = json.loads((out / "study.json").read_text())
    assert report["settings"]["seeds"] == [1] and list(report["evals"]) == ["other"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary directory left


def test_compare_keeps_the_shipped_results_and_refuses_an_out_inside_a_run(tmp_path, arms, monkeypatch):
    rec, _ = arms
    monkeypatch.chdir(tmp_path)  # the default --out is results/compare, as from the repository root
    shipped = tmp_path / "results" / "compare"
    args = ("compare", rec / "ce.yaml", rec / "del.yaml", "--no-transfer")
    assert run_cli(*args).exit_code == 0
    (shipped / "REPORT.md").write_text("the write-up")  # as the repository's results/compare has
    (shipped / "places_svamp.png").write_bytes(b"an earlier transfer plot")
    report = json.loads((shipped / "compare.json").read_text())
    report["plots"]["svamp"] = "results/compare/places_svamp.png"  # an earlier compare with --transfer
    (shipped / "compare.json").write_text(json.dumps(report))
    before = {p.name: p.read_bytes() for p in shipped.iterdir()}

    r = run_cli(*args, "--seed", "1")
    assert r.exit_code == 2 and "results/compare already holds results (compare.json" in " ".join(r.output.split())
    assert not (tmp_path / "runs" / "ce-seed1").exists()
    assert {p.name: p.read_bytes() for p in shipped.iterdir()} == before

    run = tmp_path / "runs" / "ce-seed0"
    curve = (run / LOSS_CURVE).read_bytes()
    for inside in (run, run / "plots"):
        r = run_cli(*args, "--out", inside, "--force")
        assert r.exit_code == 2 and f"is inside the run directory {run}" in " ".join(r.output.split()), r.output
    assert (run / LOSS_CURVE).read_bytes() == curve and not (run / "plots").exists()
    r = run_cli(*args, "--out", tmp_path / "runs" / "ce-seed1" / "x", "--seed", "1")  # a run still to be trained
    assert r.exit_code == 2 and "inside the run directory" in r.output
    assert not (tmp_path / "runs" / "ce-seed1").exists()

    assert run_cli(*args, "--force").exit_code == 0
    names = {p.name for p in shipped.iterdir()}
    assert names == {"compare.json", "tables.txt", "summary.md", "places_synthetic.png", "REPORT.md"}
    assert (shipped / "REPORT.md").read_text() == "the write-up"  # not compare's: kept


def test_repeated_seeds_are_refused(tmp_path, arms):
    rec, _ = arms
    data = {"recipes": ["ce.yaml", "del.yaml"], "seeds": [0, 1, 0], "out": str(tmp_path / "out"),
            "evals": {"held_out": {"limit": 2}}}
    r = run_cli("study", write_yaml(rec / "twice.study.yaml", data))
    assert r.exit_code == 2 and "seed 0 is given twice" in " ".join(r.output.split()), r.output
    r = run_cli("compare", rec / "ce.yaml", rec / "del.yaml", "--seed", "0", "--seed", "0", "--no-transfer",
                "--out", tmp_path / "out")
    assert r.exit_code == 2 and "seed 0 is given twice" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "runs").exists()
