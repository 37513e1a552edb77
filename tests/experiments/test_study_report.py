"""A study's report written again from its stored study.json (`delft study FILE --report`), and the comparison of
its runs with its pilot's runs of the same name (delft.experiments.reproduction), on hand-made study.json files."""

from __future__ import annotations

import copy
import json
from decimal import Decimal

import pytest

from delft.evaluation.metrics import summarize
from delft.experiments.breakdown import BREAKDOWN_HEADING
from delft.experiments.reproduction import (
    ADDED,
    DIFFERS,
    EQUIVALENT,
    HALF_PRECISION,
    REPRODUCTION_HEADING,
    UNUSED,
    pilot_reproduction,
    reproduction_lines,
    reproduction_rows,
)
from delft.experiments.seed_level import TABLES_HEADING
from delft.numbers.answers import Extraction, score
from delft.numbers.digits import place_name
from helpers import refused, run_cli, write_yaml

PROBLEMS = [("What is 2 + 3?", "5"), ("What is 12 * 4?", "48"), ("What is 9 - 1?", "8"), ("What is 8 / 4?", "2")]
SAID = {("ce", 0): ["5", "48", "8", "2"], ("ce", 1): ["5", "48", "8", "3"],
        ("del", 0): ["5", "47", "8", "2"], ("del", 1): ["5", "40", "7", "2"]}
LOSS = {"weight": 0.0, "tau": 1.0, "normalisation": "global", "place_weights": "reference", "place_weight_cap": 10.0}
RECIPE = {"model": {"name": "smollm2-135m", "dtype": "float32"}, "quantization": {"mode": "none"},
          "lora": {"r": 16, "alpha": 32.0}, "train": {"max_steps": 150, "seed": 0, "learning_rate": 0.0005},
          "loss": {"type": "ce", **LOSS}, "eval": {"limit": 4}, "output": {"dir": "runs/x/ce-seed0"}}


def training(loss: float, val_ce: float) -> dict:
    return {"status": "trained", "steps": 150,
            "train": {"step": 150, "loss": loss, "ce": loss, "term": 0.0, "grad_norm": 1.5},
            "validation": {"step": 150, "val_ce": val_ce, "val_term": 0.0, "val_loss": val_ce}}


def study_json(recipe: dict = RECIPE, runs: dict | None = None) -> dict:
    """The parts of a study.json that the analysis and summary.md read, with delft's own scoring and metrics."""
    models = [{"name": "base", "recipe": None, "seed": None, "metrics": summarize([], 0), "vs_reference": None,
               "predictions": []}]
    for (recipe_name, seed), answers in SAID.items():
        scored = [score(Extraction(Decimal(a), "last_number", a), Decimal(g)) for (_, g), a in zip(PROBLEMS, answers)]
        preds = [{"index": i, "gold": g, "extracted": a, "matched_text": a, "rule": "last_number", "exact": s.exact,
                  "tolerance": s.tolerance, "places": {place_name(p): ok for p, ok in s.places.items()}}
                 for i, ((_, g), a, s) in enumerate(zip(PROBLEMS, answers, scored))]
        models.append({"name": f"{recipe_name}-seed{seed}", "recipe": recipe_name, "seed": seed,
                       "metrics": summarize(scored, 0), "vs_reference": None, "predictions": preds,
                       "contamination": {"seen_in_training": 0, "n": len(PROBLEMS), "seen_problems": []}})
    section = {"settings": {"mode": "greedy", "reference": "ce", "n": len(PROBLEMS), "source": "synthetic",
                            "data": {"synthetic": {"seed": 1}}, "max_new_tokens": 8},
               "problems": [{"index": i, "question": q, "gold": g} for i, (q, g) in enumerate(PROBLEMS)],
               "models": models, "means": []}
    return {"delft_version": "0.1.0", "command": "delft study s.study.yaml", "study": "s.study.yaml",
            "description": "Does del change exact match?",
            "settings": {"recipe": recipe, "losses": {"ce": recipe["loss"], "del": {**LOSS, "type": "del",
                                                                                     "weight": 0.1}},
                         "controls": [], "calibrators": [], "decide": "t", "margin": 3.0, "margin_stated": True,
                         "plan": None, "seeds": [0, 1]},
            "training": runs or {"ce-seed0": training(0.8558516221887925, 1.1152713265217526),
                                 "del-seed0": training(0.9, 1.2), "ce-seed1": training(0.8, 1.1),
                                 "del-seed1": training(0.95, 1.25)},
            "seconds": {"training": 60.0, "total": 120.0}, "evals": {"held_out": section}, "curves": {},
            "transitions": None}


def pilot_json() -> dict:
    """The pilot: its ce runs, seed 0 logged to the last bit otherwise, and a stored dtype of 'auto'."""
    recipe = copy.deepcopy(RECIPE)
    recipe["model"]["dtype"] = "auto"
    recipe["eval"]["limit"] = 300  # the eval section is no training setting: not a difference
    recipe["output"]["dir"] = "runs/pilot/ce-seed0"
    return {**study_json(recipe, {"ce-seed0": training(0.8558531368480009, 1.1152701445028816),
                                  "ce-seed1": training(0.8, 1.1), "ce_reversed-seed0": training(1.0, 1.3)}),
            "evals": {}}


@pytest.fixture
def stored(tmp_path):
    """A study file whose out holds a study.json and the evaluation tables a study wrote, and its pilot."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.json").write_text(json.dumps(study_json(), indent=1) + "\n")
    (out / "tables.txt").write_text("the evaluation tables, as the terminal showed them\n")
    (tmp_path / "pilot").mkdir()
    (tmp_path / "pilot" / "study.json").write_text(json.dumps(pilot_json()))
    return write_yaml(tmp_path / "s.study.yaml", {
        "recipes": ["ce.yaml", "del.yaml"], "seeds": [0, 1], "out": str(out), "plan": {"pilot": "pilot"},
        "evals": {"held_out": {"limit": 4}}})


def test_the_report_is_written_again_from_study_json_alone(stored, tmp_path):
    out = tmp_path / "out"
    before = json.loads((out / "study.json").read_text())
    r = run_cli("study", stored, "--report")
    assert r.exit_code == 0, r.output
    report = json.loads((out / "study.json").read_text())
    assert report["evals"] == before["evals"] and report["training"] == before["training"]  # the data kept
    assert [row["recipe"] for row in report["seed_level"]] == ["del"] and report["verdicts"]["arms"]
    groups = {g["group"]: g for g in report["breakdown"][0]["groupings"]["digits"]}
    assert groups["2"]["n"] == 1 and groups["2"]["vs_reference"]["del"]["exact_match"] == -1.0  # 48: 47, 40
    summary = (out / "summary.md").read_text()  # one-digit golds: ce misses 2 once (3), del misses 8 once (7)
    assert "## Verdicts" in summary and "| 1 | 3 | exact match % | 83.3 | 83.3 | +0.0 |" in summary
    assert f"## {REPRODUCTION_HEADING}" in summary and "model.dtype ('auto' -> 'float32'), equivalent" in summary
    assert "| ce-seed0 | same settings | no | 1.77e-06 (train.loss) |" in summary
    tables = (out / "tables.txt").read_text()
    assert tables.startswith("the evaluation tables, as the terminal showed them\n")
    for heading in (TABLES_HEADING, BREAKDOWN_HEADING, REPRODUCTION_HEADING):
        assert tables.count(heading) == 1, heading
    written = {name: (out / name).read_text() for name in ("study.json", "summary.md", "tables.txt")}
    assert run_cli("study", stored, "--report").exit_code == 0  # again: the analysis block replaced, not added
    assert {name: (out / name).read_text() for name in written} == written


def test_the_report_is_refused_without_a_study_json_or_beside_training(stored, tmp_path):
    (tmp_path / "out" / "study.json").unlink()
    refused(run_cli("study", stored, "--report"), "study.json", "is not there", "Run the study to the end first")
    refused(run_cli("study", stored, "--report", "--plan"), "--report trains and evaluates nothing", "--plan")
    refused(run_cli("study", stored, "--report", "--allow-seen"), "--report trains and evaluates nothing",
            "--allow-seen")
    refused(run_cli("study", stored, "--report", "--set", "train.max_steps=5"), "recipe keys",
            "train.max_steps=5")


def test_the_pilots_runs_compared_by_name_settings_and_final_records():
    rows = {r["run"]: r for r in reproduction_rows(pilot_json(), study_json())}
    assert list(rows) == ["ce-seed0", "ce-seed1"]  # del the pilot never ran, ce_reversed this study never ran
    first, second = rows["ce-seed0"], rows["ce-seed1"]
    assert [(d["key"], d["pilot"], d["study"], d["class"]) for d in first["settings_differ"]] == [
        ("model.dtype", "auto", "float32", EQUIVALENT)]
    assert first["settings_same"] and second["settings_same"]
    assert not first["bitwise"] and second["bitwise"] and second["largest_relative"]["value"] == 0
    loss = next(f for f in first["finals"] if f["key"] == "train.loss")
    expected = (0.8558531368480009 - 0.8558516221887925) / 0.8558531368480009
    assert not loss["equal"] and loss["relative"] == pytest.approx(expected)
    assert first["largest_relative"] == {"key": "train.loss", "value": pytest.approx(expected)}
    val = next(f for f in first["finals"] if f["key"] == "validation.val_ce")
    assert val["relative"] == pytest.approx((1.1152713265217526 - 1.1152701445028816) / 1.1152713265217526)
    assert next(f for f in first["finals"] if f["key"] == "train.term")["equal"]


def test_the_same_settings_and_records_reproduce_bit_for_bit():
    study = study_json()
    rows = reproduction_rows(copy.deepcopy(study), study)
    assert rows and all(r["settings_same"] and r["bitwise"] and not r["settings_differ"] for r in rows)
    lines = "\n".join(reproduction_lines({"pilot": "p", "runs": rows}))
    assert "**Same settings**: the stored recipes are equal" in lines and "bit for bit equal** in every" in lines
    other_loss = copy.deepcopy(study)  # a run's own loss is compared, not the first recipe's
    other_loss["settings"]["losses"]["del"]["weight"] = 0.3
    by = {r["run"]: r for r in reproduction_rows(study, other_loss)}
    assert by["ce-seed0"]["settings_same"] and not by["del-seed0"]["settings_same"]
    assert [(d["key"], d["pilot"], d["study"], d["class"]) for d in by["del-seed0"]["settings_differ"]] == [
        ("loss.weight", 0.1, 0.3, DIFFERS)]
    lines = "\n".join(reproduction_lines({"pilot": "p", "runs": list(by.values())}))
    assert "**Settings differ**: loss.weight (0.1 -> 0.3) (in del-seed0, del-seed1)." in lines
    assert "| del-seed0 | settings differ: loss.weight |" in lines and "| ce-seed0 | same settings |" in lines


def compared(pilot_changes: dict, study_changes: dict, pilot_record: dict | None = None,
             study_record: dict | None = None) -> dict:
    """ce-seed0 compared, each side's RECIPE changed by {section: {key: value}} and its training record given
    (default: the same records, bit for bit)."""
    sides = []
    for changes, record in ((pilot_changes, pilot_record), (study_changes, study_record)):
        recipe = copy.deepcopy(RECIPE)
        for section, keys in changes.items():
            recipe.setdefault(section, {}).update(keys)
        sides.append(study_json(recipe, {"ce-seed0": record or training(0.8, 1.1)}))
    (row,) = reproduction_rows(*sides)
    return row


def classes(row: dict) -> dict[str, str]:
    return {d["key"]: d["class"] for d in row["settings_differ"]}


def test_a_key_added_since_the_pilot_at_its_default_is_no_difference_and_a_set_one_is():
    row = compared({}, {"train": {"keep_best": False}, "data": {"columns": None}})  # absent from the pilot's recipe
    assert classes(row) == {"train.keep_best": ADDED, "data.columns": ADDED} and row["settings_same"]
    row = compared({}, {"train": {"keep_best": True}})  # a new key set away from its default changes training
    assert classes(row) == {"train.keep_best": DIFFERS} and not row["settings_same"]


def test_a_data_section_the_source_does_not_read_is_unused_and_the_one_it_reads_is_not():
    row = compared({"data": {"nupa": {"min_length": 1}}}, {"data": {"nupa": {"min_length": 2}}})  # synthetic
    assert classes(row) == {"data.nupa.min_length": UNUSED} and row["settings_same"]
    assert "data.nupa is read only when data.source is nupa (here synthetic)" in row["settings_differ"][0]["why"]
    row = compared({"data": {"synthetic": {"n": 2000}}}, {"data": {"synthetic": {"n": 1000}}})
    assert classes(row) == {"data.synthetic.n": DIFFERS}
    nupa = {"source": "nupa", "format": "nupa"}
    row = compared({"data": {**nupa, "nupa": {"min_length": 1}}}, {"data": {**nupa, "nupa": {"min_length": 2}}})
    assert classes(row) == {"data.nupa.min_length": DIFFERS}


def test_an_auto_is_resolved_on_the_device_its_run_stored():
    auto = {"model": {"dtype": "auto"}, "quantization": {"mode": "auto"}}
    far = training(0.9, 1.2)  # records that tell nothing: only the stored device decides
    on_cpu = compared(auto, {}, pilot_record={**far, "device": "cpu"})
    assert classes(on_cpu) == {"model.dtype": EQUIVALENT, "quantization.mode": EQUIVALENT}
    assert all("device cpu in its study.json" in d["why"] for d in on_cpu["settings_differ"])
    on_gpu = compared(auto, {}, pilot_record={**far, "device": "cuda"})  # bf16 or fp16 there, nf4 for LoRA
    assert classes(on_gpu) == {"model.dtype": DIFFERS, "quantization.mode": DIFFERS} and not on_gpu["settings_same"]
    why = {d["key"]: d["why"] for d in on_gpu["settings_differ"]}
    assert "bf16 or fp16" in why["model.dtype"] and "auto was nf4" in why["quantization.mode"]
    explicit = compared({"model": {"device": "cpu", "dtype": "auto"}}, {"model": {"device": "cpu"}}, far)
    assert classes(explicit) == {"model.dtype": EQUIVALENT}  # the recipe's own model.device says where


def test_an_auto_is_read_from_the_runs_delft_run_json_where_its_directory_is_there(tmp_path):
    run = tmp_path / "ce-seed0"
    run.mkdir()
    record = {**training(0.9, 1.2), "run": str(run)}
    for stored, verdict in (("nf4", DIFFERS), ("none", EQUIVALENT)):
        (run / "delft_run.json").write_text(json.dumps({"status": "completed", "step": 150, "quantization": stored}))
        row = compared({"quantization": {"mode": "auto"}}, {}, pilot_record=record)
        assert classes(row) == {"quantization.mode": verdict}
        why = row["settings_differ"][0]["why"]
        assert f"auto was {stored}" in why and f"quantization {stored} in its delft_run.json" in why
    (run / "delft_run.json").write_text(json.dumps({"status": "completed", "step": 90, "quantization": "none"}))
    row = compared({"quantization": {"mode": "auto"}}, {}, pilot_record=record)  # another run of that directory
    assert classes(row) == {"quantization.mode": DIFFERS} and row["stored"]["pilot"]["read"] == ["study.json"]


def test_an_auto_with_no_device_stored_is_read_from_how_closely_the_final_records_agree():
    auto = {"model": {"dtype": "auto"}}
    close = compared(auto, {}, training(0.8558531368480009, 1.1), training(0.8558516221887925, 1.1))
    assert classes(close) == {"model.dtype": EQUIVALENT} and close["settings_same"]
    assert "no device or resolved value in its study.json" in close["settings_differ"][0]["why"]
    apart = 0.8 * (1 + 2 * HALF_PRECISION)  # what a bf16 or fp16 run beside a float32 one would show
    far = compared(auto, {}, training(0.8, 1.1), training(apart, 1.1))
    assert classes(far) == {"model.dtype": DIFFERS} and "is not known" in far["settings_differ"][0]["why"]
    lines = "\n".join(reproduction_lines({"pilot": "p", "runs": [far]}))
    assert "**Settings differ**: model.dtype ('auto' -> 'float32'): what auto became" in lines
    assert "Not bit for bit with the same settings" not in lines  # a real difference explains the records


def test_the_verdict_lists_what_does_not_change_training_and_why_records_are_not_bitwise():
    pilot = {"model": {"dtype": "auto"}, "quantization": {"mode": "auto"}, "data": {"nupa": {"min_length": 1}}}
    study = {"data": {"columns": None, "nupa": {"min_length": 2}}}
    row = compared(pilot, study, training(0.8558531368480009, 1.1), training(0.8558516221887925, 1.1))
    lines = "\n".join(reproduction_lines({"pilot": "p", "runs": [row]}))
    assert "**Same settings** for every shared run: the stored recipes differ only where training does not: " in lines
    assert "data.columns (absent -> None), added since" in lines and "data.nupa.min_length (1 -> 2), unused" in lines
    assert "model.dtype ('auto' -> 'float32') and quantization.mode ('auto' -> 'none'), equivalent" in lines
    assert "Not bit for bit with the same settings" in lines and "stores its thread count or torch version" in lines
    threads = compared({}, {}, {**training(0.8, 1.1), "threads": 2, "torch_version": "2.12.0"},
                       {**training(0.80000001, 1.1), "threads": 1, "torch_version": "2.13.0"})
    lines = "\n".join(reproduction_lines({"pilot": "p", "runs": [threads]}))
    assert "Stored: ce-seed0: threads 2 -> 1, torch_version 2.12.0 -> 2.13.0." in lines


def test_no_pilot_or_no_shared_run_gives_no_section_and_an_unreadable_pilot_says_so(tmp_path):
    assert pilot_reproduction(study_json(), None) is None
    (tmp_path / "other.json").write_text(json.dumps({**pilot_json(), "training": {"dft-seed0": training(1, 1)}}))
    assert pilot_reproduction(study_json(), tmp_path / "other.json") is None
    gone = pilot_reproduction(study_json(), tmp_path / "nowhere")
    assert gone["runs"] == [] and "nowhere" in gone["pilot"] and gone["error"]


def test_the_losses_table_shows_a_digit_terms_settings_only_where_there_is_a_term():
    """dft weighs CE itself (no digit term: no weight, normalisation or place weights to show, as for ce); ntl_was
    has a term but no place weights; del has all three."""
    from delft.experiments.summary import study_summary

    report = study_json()
    report["settings"]["losses"].update({"dft": {**LOSS, "type": "dft"},
                                         "ntl": {**LOSS, "type": "ntl_was", "weight": 0.3}})
    summary = study_summary(report)
    for row in ("| ce | ce | - | - | - |", "| dft | dft | - | - | - |", "| ntl | ntl_was | 0.3 | global | - |",
                "| del | del | 0.1 | global | reference |"):
        assert row in summary, summary[:2000]
