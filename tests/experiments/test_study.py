"""delft study: the shipped study files resolve; a tiny study end to end (greedy and teacher-forced sets, seed
pooling, the detectable difference); refusals."""

import json

import pytest
import yaml
from helpers import DATA, REPO, run_cli, write_arms, write_yaml
from rich.console import Console

from delft.errors import UserError
from delft.experiments.study import _contenders, run_study
from delft.experiments.study_file import eval_data, load_study
from delft.recipe.files import load_recipe

STUDIES = sorted((REPO / "recipes" / "study").glob("*.study.yaml"))
LOSS_STUDIES = [p for p in STUDIES if p.name in ("arithmetic.study.yaml", "worked.study.yaml")]  # SmolLM2 LoRA
SCRATCH_STUDIES = [p for p in STUDIES if p.name.startswith(("scratch", "scale_"))]  # models from scratch
COMPACT_STUDIES = [p for p in STUDIES if p.name.startswith("compact")]  # pre-registered, with its pilots
FORMATS_STUDIES = [p for p in STUDIES if p.name.startswith("formats")]  # number forms x losses
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def quiet() -> Console:
    return Console(width=160, record=True)


@pytest.mark.parametrize("path", LOSS_STUDIES, ids=lambda p: p.name)
def test_shipped_studies_resolve(path, tmp_path):
    study = load_study(path)
    assert path.read_text().startswith(f"# delft study recipes/study/{path.name}")
    (tmp_path / "gsm8k_train.jsonl").write_text((DATA / "gsm8k_test.jsonl").read_text())  # any GSM8K rows
    for name in ("gsm8k_test.jsonl", "svamp.json"):
        (tmp_path / name).write_text((DATA / name).read_text())
    contenders = _contenders(study, path, [], tmp_path, quiet())
    names = [c.name for c in contenders]
    assert names == ["ce", "del", "del_ref", "del_prob", "ntl_was"] and len(study.seeds) >= 3
    quick = load_recipe(QUICKSTART).loss
    by = {c.name: c.recipe.loss for c in contenders}
    assert by["del_prob"] == quick  # the quickstart's own loss is one arm
    assert by["del"].type == by["del_ref"].type == "del" and by["del_ref"].weight == pytest.approx(0.01 * 32 * 4)
    assert by["del"].weight == load_recipe(None, ["loss.type=del"]).loss.weight  # delft's default weight
    for c in contenders:  # each arm runs beside its study's other runs
        assert str(c.for_seed(2).output.dir) == f"runs/study/{path.name.split('.')[0]}/{c.name}-seed2"
    cfg0 = contenders[0].for_seed(0)
    for name, spec in study.evals.items():
        data = eval_data(name, spec, cfg0, tmp_path)
        if data.source == "synthetic":
            assert data.synthetic.seed != cfg0.data.synthetic.seed  # held out from training


def test_every_shipped_study_is_tested_here():
    others = {REPO / "recipes" / "study" / f"{name}.study.yaml" for name in ("grpo", "del_prob_weight", "lora_powered")}
    assert set(STUDIES) == set(LOSS_STUDIES) | set(SCRATCH_STUDIES) | set(COMPACT_STUDIES) | set(FORMATS_STUDIES) \
        | others


def test_the_powered_lora_study_is_pre_registered_as_issued():
    """Issue 54's design: SmolLM2 fp32 LoRA on the arithmetic recipe, ce / del_prob 1.0 / del 0.1 (calibrator) / dft,
    10 paired seeds, 800 held-out problems, the two-way interval deciding, TOST at +-2.5; --plan works on it."""
    from delft.experiments.study import plan_study

    path = REPO / "recipes" / "study" / "lora_powered.study.yaml"
    study = load_study(path)
    assert path.read_text().startswith(f"# delft study recipes/study/{path.name}")
    assert study.seeds == list(range(10)) and study.decide == "two_way" and study.margin == 2.5
    assert study.calibrators() == ["del"] and study.controls() == [] and study.evals["held_out"].limit == 800
    contenders = _contenders(study, path, [], None, quiet())
    by = {c.name: c.recipe for c in contenders}
    assert [c.name for c in contenders] == ["ce", "del_prob", "del", "dft"]
    assert (by["del_prob"].loss.type, by["del_prob"].loss.weight) == ("del_prob", 1.0)
    assert (by["del"].loss.type, by["del"].loss.weight) == ("del", 0.1) and by["dft"].loss.type == "dft"
    r = by["ce"]
    assert (r.lora.r, r.lora.alpha, r.model.dtype, r.quantization.mode) == (16, 32, "float32", "none")
    assert (r.train.max_steps, r.train.batch_size, r.train.learning_rate, r.train.lr_scheduler) == (150, 8, 5e-4,
                                                                                                  "cosine")
    assert (r.data.synthetic.n, r.data.synthetic.max_digits, r.data.synthetic.ops) == (2000, 3, ["+", "-", "*", "/"])
    console = quiet()
    plan = plan_study(path, console=console)
    rows = {row["recipe"]: row for row in plan["rows"]}
    assert rows["del"]["alpha"] == 0.05 and rows["del_prob"]["alpha"] == pytest.approx(0.025)  # alone; Holm over 2
    assert plan["family"] == 2 and all(row["decide"] == "two_way" for row in plan["rows"])
    assert plan["flags"] == []  # the calibrator moved down in its pilot (formats_lora, p 0.03 alone)


@pytest.mark.parametrize("path", FORMATS_STUDIES, ids=lambda p: p.name)
def test_the_formats_studies_cross_three_forms_with_two_losses(path, tmp_path):
    """Natural, reversed and count-prefixed answers, each with CE and with del at 0.1; everything else shared with
    the task they stand on (the compact study's, or the LoRA arithmetic study's); CE natural is the reference."""
    study = load_study(path)
    contenders = _contenders(study, path, [], tmp_path, quiet())
    forms = {c.name: (c.recipe.data.numbers.order, c.recipe.data.numbers.count_prefix, c.recipe.loss.type,
                      c.recipe.loss.weight) for c in contenders}
    assert forms == {"ce": ("natural", False, "ce", 0.0), "ce_reversed": ("reversed", False, "ce", 0.0),
                     "ce_prefix": ("natural", True, "ce", 0.0), "del": ("natural", False, "del", 0.1),
                     "del_reversed": ("reversed", False, "del", 0.1), "del_prefix": ("natural", True, "del", 0.1)}
    assert contenders[0].name == "ce" and all(
        c.recipe.data.numbers.scope == "answer" for c in contenders if c.recipe.data.numbers.active())
    shared = "compact/ce.yaml" if path.name == "formats.study.yaml" else "arithmetic/ce.yaml"
    base = load_recipe(path.parent / shared)
    assert contenders[0].recipe.data == base.data  # train differs only in the curve's snapshots
    assert contenders[0].recipe.train.model_copy(update={"snapshot_steps": []}) == base.train
    assert (path.parent / study.plan.pilot).resolve().is_dir()
    if path.name == "formats.study.yaml":
        assert study.controls() == ["ce_reversed"] and study.learns_at == 0.5 and len(study.seeds) == 10


@pytest.mark.parametrize("path", COMPACT_STUDIES, ids=lambda p: p.name)
def test_the_compact_studies_are_written_before_their_runs(path, tmp_path):
    """The compact study and its pilots: compact unseen problems from scratch, CE as reference and ntl_was as the
    control, learns_at measured by every arm; the study's 10 paired seeds, endpoints and rules in its description,
    and its plan read from the pilot it names."""
    study = load_study(path)
    contenders = _contenders(study, path, [], tmp_path, quiet())
    by = {c.name: c.recipe for c in contenders}
    assert [r.loss.type for r in by.values()][0] == "ce" and study.controls() == ["ntl_was"]
    assert study.learns_at == 0.5 and study.margin == 3.0
    for r in by.values():
        assert r.model.init == "scratch" and r.data.synthetic.style == "compact" and r.data.prompt_separator() == ""
        assert r.train.accuracy_steps == 100 and r.train.max_steps == 1500
    if path.name == "compact.study.yaml":
        assert study.seeds == list(range(10)) and list(by) == ["ce", "del_prob", "del", "ntl_was"]
        assert all(w in study.description for w in ("Endpoints", "area under", "first step", "sign-flip", "Holm"))
        assert (path.parent / study.plan.pilot).resolve() == (REPO / "results" / "study" / "compact_pilot_add")
        assert by["ce"].data.synthetic.ops == ["+"]
    else:
        assert study.seeds == [0, 1, 2] and "Pilot" in study.description


def test_the_weight_sweep_is_the_arithmetic_study_at_four_del_prob_weights(tmp_path):
    path = REPO / "recipes" / "study" / "del_prob_weight.study.yaml"
    study = load_study(path)
    contenders = _contenders(study, path, [], tmp_path, quiet())
    by = {c.name: c.recipe for c in contenders}
    assert [(r.loss.type, r.loss.weight) for r in by.values()] == [("ce", 0.0), ("del_prob", 0.3), ("del_prob", 1.0),
                                                                  ("del_prob", 3.0), ("del_prob", 10.0)]
    arithmetic = load_study(REPO / "recipes" / "study" / "arithmetic.study.yaml")
    ce = _contenders(arithmetic, REPO / "recipes" / "study" / "arithmetic.study.yaml", [], tmp_path, quiet())[0]
    assert by["ce"] == ce.recipe  # the same runs: the arithmetic study's ce and del_prob arms are reused
    assert by["del_prob"].loss == load_recipe(QUICKSTART).loss


@pytest.mark.parametrize("path", SCRATCH_STUDIES, ids=lambda p: p.name)
def test_the_scratch_studies_say_in_advance_what_would_answer_them(path, tmp_path):
    study = load_study(path)
    assert path.read_text().startswith(f"# delft study recipes/study/{path.name}")
    assert "Stated before the runs" in study.description and study.margin == 3.0
    contenders = _contenders(study, path, [], tmp_path, quiet())
    by = {c.name.split("_", 1)[-1] if c.name.startswith(("small_", "large_")) else c.name: c.recipe
          for c in contenders}
    assert {"ce", "del_prob"} <= set(by) and by["del_prob"].loss.weight == 1.0
    for r in by.values():
        assert r.model.init == "scratch" and r.model.tokenizer == "char" and r.train.finetuning == "full"
        assert r.train.snapshot_steps == study.curve and len(study.curve) == 3  # 4 points with the end
        assert study.curve[-1] < r.train.max_steps
    scratch = load_study(REPO / "recipes" / "study" / "scratch.study.yaml")
    same = _contenders(scratch, REPO / "recipes" / "study" / "scratch.study.yaml", [], tmp_path, quiet())[0].recipe
    for r in by.values():  # the scale studies change only the model's size
        assert r.data == same.data and r.train == same.train and r.model.tokenizer == same.model.tokenizer
    if path.name == "scratch.study.yaml":
        assert study.controls() == ["ntl_was"] and len(study.seeds) == 4 and set(by) == {"ce", "del_prob", "del",
                                                                                          "ntl_was"}


def test_the_grpo_study_resolves_to_its_four_arms(tmp_path):
    path = REPO / "recipes" / "study" / "grpo.study.yaml"
    study = load_study(path)
    assert path.read_text().startswith("# delft study recipes/study/grpo.study.yaml")
    contenders = _contenders(study, path, [], tmp_path, quiet())
    by = {c.name: c.recipe for c in contenders}
    assert list(by) == ["grpo", "grpo_ce", "grpo_del", "grpo_partial"] and len(study.seeds) >= 2
    for r in by.values():  # every arm continues the quickstart's adapter with GRPO
        assert r.train.stage == "grpo" and r.model.adapter == "runs/quickstart"
    assert (by["grpo"].grpo.aux_mu, by["grpo"].grpo.reward) == (0.0, "exact")
    assert by["grpo_ce"].grpo.aux_mu > 0 and by["grpo_ce"].loss.type == "ce"
    assert by["grpo_del"].grpo == by["grpo_ce"].grpo and by["grpo_del"].loss.type == "del_prob"
    assert by["grpo_partial"].grpo.reward == "partial" and by["grpo_partial"].grpo.aux_mu == 0.0
    quick = load_recipe(QUICKSTART)
    assert by["grpo"].data.synthetic.seed != quick.data.synthetic.seed  # other problems than the SFT stage's


def test_worked_study_evaluates_enough_gold_solutions_with_room_to_reason():
    study = load_study(REPO / "recipes" / "study" / "worked.study.yaml")
    gold = [s for s in study.evals.values() if s.mode == "teacher_forced"]
    greedy = [s for s in study.evals.values() if s.mode == "greedy"]
    assert gold and all(s.limit >= 300 and s.format == "gsm8k" for s in gold)
    assert {s.format for s in greedy} == {"gsm8k", "svamp"} and all(s.max_new_tokens >= 256 for s in greedy)


@pytest.fixture
def tiny_study(tmp_path, tiny_model_dir):
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs", eval={"bootstrap": 50},
                     data={"max_length": 512, "template": "plain"})  # the tiny model's context; plain as shipped
    study = write_yaml(rec / "tiny.study.yaml", {
        "recipes": ["ce.yaml", "del.yaml"], "seeds": [0, 1], "out": str(tmp_path / "out"),
        "evals": {"held_out": {"limit": 4, "max_new_tokens": 4},
                  "long_gold": {"limit": 5, "mode": "teacher_forced", "synthetic": {"min_digits": 3, "max_digits": 4}},
                  "gsm8k_gold": {"source": "gsm8k_test.jsonl", "format": "gsm8k", "limit": 3,
                                 "mode": "teacher_forced"}}})
    return study


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path, tiny_study):
    report = run_study(tiny_study, data_dir=DATA, console=quiet())
    out = tmp_path / "out"
    on_disk = json.loads((out / "study.json").read_text())
    assert on_disk["evals"].keys() == {"held_out", "long_gold", "gsm8k_gold"}
    assert {v["status"] for v in on_disk["training"].values()} == {"trained"} and len(on_disk["training"]) == 4
    names = ["base", "ce-seed0", "del-seed0", "ce-seed1", "del-seed1"]
    held = on_disk["evals"]["held_out"]
    assert [m["name"] for m in held["models"]] == names and all(len(m["predictions"]) == 4 for m in held["models"])
    for key, n in (("long_gold", 5), ("gsm8k_gold", 3)):
        sec = on_disk["evals"][key]
        assert sec["settings"]["mode"] == "teacher_forced" and sec["settings"]["n"] == n
        assert [m["name"] for m in sec["models"]] == names
        assert all(len(m["per_example"]) == n for m in sec["models"])
        # the pooled digit accuracy is the mean of the seeds' (same gold digits for every model)
        seeds = [m["metrics"]["digits"]["digit_accuracy"] for m in sec["models"] if m["recipe"] == "del"]
        pooled = sec["means"][1]
        assert pooled["metrics"]["digits"]["digit_accuracy"] == pytest.approx(sum(seeds) / 2)
        # ... and its difference from ce is the mean of the per-seed differences
        per_seed = [m["vs_reference"]["digits"]["digit_accuracy"]["difference"] for m in sec["models"]
                    if m["recipe"] == "del"]
        assert pooled["vs_reference"]["digits"]["digit_accuracy"]["difference"] == pytest.approx(sum(per_seed) / 2)
        # per-example records add up to the model's digit accuracy
        m = sec["models"][1]
        assert m["metrics"]["truncated"] == 0 and m["metrics"]["digits"]["n"] > 0
        ok, total = sum(r["digit_ok"] for r in m["per_example"]), sum(r["digits"] for r in m["per_example"])
        assert total == m["metrics"]["digits"]["n"] and ok / total == pytest.approx(m["metrics"]["digits"]["digit_accuracy"])
        assert (out / f"{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gsm = on_disk["evals"]["gsm8k_gold"]["settings"]
    assert gsm["data"]["source"] == str(DATA / "gsm8k_test.jsonl") and gsm["data"]["format"] == "gsm8k"
    long = on_disk["evals"]["long_gold"]["settings"]["data"]["synthetic"]
    assert (long["min_digits"], long["max_digits"]) == (3, 4)
    summary = (out / "summary.md").read_text()
    assert "#### held_out (4 problems, greedy): difference from ce" in summary
    rows = on_disk["seed_level"]  # the seed as the unit, Holm over the comparisons: greedy sets only
    assert rows and {r["set"] for r in rows} <= {k for k, v in on_disk["evals"].items()
                                                  if v["settings"]["mode"] == "greedy"}
    for r in rows:
        assert r["recipe"] == "del" and r["reference"] == "ce" and r["holm_p"] >= r["t_test"]["p"]
        lo, hi = r["t_test"]["ci"] or (None, None)  # no interval when both seeds differ by the same amount
        assert (lo is None and r["t_test"]["p_from"].startswith("sign")) or lo <= r["difference"] <= hi
        assert len(r["t_test"]["per_seed"]) == len(r["seeds"]) == 2
        assert r["sign_flip"]["smallest_possible_p"] == 0.5 and r["bootstrap"]["p"] > 0
    assert "## With the seed as the unit" in summary
    _check_the_analysis_in_tables_and_its_rewrite(out, on_disk, summary)
    assert "| del | teacher-forced digit accuracy, points |" in summary and "| **del (mean)** |" in summary
    assert "--data-dir" in on_disk["command"] and report["seconds"]["total"] > 0
    assert "detectable (pooled)" not in summary  # a per-problem power figure leaves seed variance out

    again = run_study(tiny_study, data_dir=DATA, console=quiet(), train_only=True)
    assert again is None  # every run finished: reused, nothing retrained
    assert json.loads((tmp_path / "runs" / "ce-seed1" / "delft_run.json").read_text())["status"] == "completed"


def _check_the_analysis_in_tables_and_its_rewrite(out, on_disk, summary):
    """tables.txt records the seed-level rows and verdicts as the terminal showed them; the rewrite from
    study.json recomputes the same analysis and replaces that block instead of adding a second one."""
    from delft.experiments.seed_level import TABLES_HEADING
    from delft.experiments.summary import rewrite

    tables = (out / "tables.txt").read_text()
    assert tables.count(TABLES_HEADING) == 1 and "del vs ce" in tables.split(TABLES_HEADING)[1]
    for _ in range(2):
        rewrite(out)
    again = (out / "tables.txt").read_text()
    assert again.count(TABLES_HEADING) == 1 and again.split(TABLES_HEADING)[0] == tables.split(TABLES_HEADING)[0]
    assert json.loads((out / "study.json").read_text())["seed_level"] == on_disk["seed_level"]
    assert (out / "summary.md").read_text() == summary


def test_a_one_seed_study_has_its_differences_and_every_table(tmp_path, tiny_study):
    """One training seed: the greedy differences from ce are in summary.md (pooled = that seed), and the
    teacher-forced tables are on screen and in tables.txt like the greedy ones, all under `delft study`."""
    data = yaml.safe_load(tiny_study.read_text())
    data["seeds"] = [0]
    del data["evals"]["gsm8k_gold"]
    one = write_yaml(tiny_study.parent / "one.study.yaml", data)
    console = quiet()
    report = run_study(one, console=console)
    summary = (tmp_path / "out" / "summary.md").read_text()
    greedy = summary.split("#### held_out")[1].split("####")[0]
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[3:-1]] for r in greedy.splitlines()
            if r.startswith("| del |")}
    assert set(rows) == {"exact match, points", "tolerance match, points"}, greedy
    diff = next(m for m in report["evals"]["held_out"]["models"] if m["name"] == "del-seed0")["vs_reference"]
    for label, key in (("exact match, points", "exact_match"), ("tolerance match, points", "tolerance_match")):
        seed, pooled = rows[label]
        assert seed == pooled != "-" and f"{100 * diff[key]['difference']:+.1f}" in pooled
    tables = " ".join((tmp_path / "out" / "tables.txt").read_text().split())  # titles wrap over narrow tables
    screen = " ".join(console.export_text().split())
    for text in (tables, screen):
        assert "delft study, held_out" in text and "delft compare" not in text
        title = "delft study, long_gold: 5 gold completions, teacher-forced, training seed 0"
        assert title in text and "digit argmax accuracy" in text.split(title)[1], text
        assert "del vs ce (seed 0, teacher-forced" in text


def test_refuses_a_missing_data_file_before_training(tmp_path, tiny_study):
    with pytest.raises(UserError, match="gsm8k_test.jsonl does not exist.*--data-dir"):
        run_study(tiny_study, data_dir=tmp_path, console=quiet())
    assert not (tmp_path / "runs").exists()


def test_unknown_study_key_is_named(tmp_path, tiny_study):
    data = yaml.safe_load(tiny_study.read_text())
    data["evals"]["held_out"]["max_new_token"] = 3
    bad = write_yaml(tmp_path / "recipes" / "bad.study.yaml", data)
    result = run_cli("study", str(bad))
    assert result.exit_code == 2
    assert "evals.held_out.max_new_token" in result.output and "Traceback" not in result.output


def test_data_files_are_looked_up_in_data_dir_and_hub_ids_pass_through(tmp_path):
    from delft.experiments.study_file import data_file as _data_file

    (tmp_path / "rows.jsonl").write_text("{}\n")
    assert _data_file("rows.jsonl", tmp_path, "evals.x.source") == str(tmp_path / "rows.jsonl")
    assert _data_file("openai/gsm8k", tmp_path, "evals.x.source") == "openai/gsm8k"  # a hub id: the loader's job
    with pytest.raises(UserError, match="missing.jsonl does not exist"):
        _data_file("missing.jsonl", tmp_path, "evals.x.source")
