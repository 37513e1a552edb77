"""delft compare: the shipped recipes differ only in the loss; a tiny end-to-end compare; refusals."""

import json

import pytest
from helpers import REPO, run_cli, write_arms, write_yaml
from rich.console import Console

from delft.errors import UserError
from delft.experiments.compare import run_compare
from delft.experiments.contenders import resolve_contenders
from delft.recipe.keys import flat_keys

COMPARE = REPO / "recipes" / "compare"


def quiet() -> Console:
    return Console(width=160, record=True)


def test_shipped_compare_recipes_differ_only_in_loss():
    contenders = resolve_contenders(sorted(COMPARE.glob("*.yaml")), [], quiet())
    assert sorted(c.name for c in contenders) == ["ce", "del", "dist2", "ntl_was"]  # base.yaml is the shared base
    settings = []
    for c in contenders:
        assert c.recipe.loss.type == c.name
        d = flat_keys(c.recipe.to_dict())
        assert d.pop("output.dir") == f"runs/compare/{c.name}-seed0"
        settings.append({k: v for k, v in d.items() if not k.startswith("loss.")})
    assert all(s == settings[0] for s in settings[1:])
    assert settings[0]["model.name"] == "smollm2-135m" and settings[0]["data.source"] == "synthetic"
    # every seed gets its own run directory beside the recipe's output.dir
    assert str(contenders[0].for_seed(1).output.dir) == f"runs/compare/{contenders[0].name}-seed1"
    assert contenders[0].for_seed(1).train.seed == 1


@pytest.fixture
def tiny_recipes(tmp_path, tiny_model_dir):
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs",
                     eval={"limit": 4, "max_new_tokens": 4, "bootstrap": 20})
    base, ce, de = rec / "base.yaml", rec / "ce.yaml", rec / "del.yaml"
    svamp = tmp_path / "svamp.json"
    svamp.write_text(json.dumps([{"ID": f"x{i}", "Body": f"Tom has {i + 2} apples and buys {i} more.",
                                  "Question": "How many apples does he have?", "Equation": "", "Answer": 2.0 * i + 2,
                                  "Type": "Addition"} for i in range(5)]))
    return base, ce, de, svamp


@pytest.mark.slow
def test_tiny_compare_end_to_end_and_rerun_reproduces(tmp_path, tiny_recipes):
    base, ce, de, svamp = tiny_recipes
    out = tmp_path / "out"
    kwargs = {"seeds": [0, 1], "overrides": [], "transfer": str(svamp), "transfer_limit": 3,
              "transfer_max_new_tokens": 4}
    report = run_compare([base, ce, de], out=out, console=quiet(), **kwargs)

    names = ["base", "ce-seed0", "del-seed0", "ce-seed1", "del-seed1"]
    for run in names[1:]:
        info = json.loads((tmp_path / "runs" / run / "delft_run.json").read_text())
        assert info["status"] == "completed" and report["training"][run]["status"] == "trained"
    assert not (tmp_path / "runs" / "base-seed0").exists()  # the shared base is not a run
    on_disk = json.loads((out / "compare.json").read_text())
    assert set(on_disk["evals"]) == {"synthetic", "svamp"}
    for key, n in (("synthetic", 4), ("svamp", 3)):
        section = on_disk["evals"][key]
        assert [m["name"] for m in section["models"]] == names
        assert section["settings"]["n"] == n and len(section["problems"]) == n
        for m in section["models"]:
            assert len(m["predictions"]) == n and "exact_match_ci" in m["metrics"]
            assert (m["vs_base"] is None) == (m["name"] == "base")
        assert [m["vs_reference"] is None for m in section["models"]] == [True, True, False, True, False]
        assert [m["name"] for m in section["means"]] == ["ce", "del"]
        mean = section["means"][0]["metrics"]
        assert mean["n"] == n and mean["predictions"] == 2 * n and mean["per_seed"]["exact_match"][0] is not None
        assert {k: v["n"] for k, v in mean["per_place"].items()} == {
            k: v["n"] for k, v in section["models"][1]["metrics"]["per_place"].items()}  # problems, not predictions
        assert section["means"][1]["vs_reference"]["exact_match"]["difference"] is not None
        assert (out / f"places_{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert on_disk["evals"]["svamp"]["settings"]["max_new_tokens"] == 4
    assert on_disk["evals"]["synthetic"]["settings"]["data"]["synthetic"]["seed"] != 0  # held out
    assert on_disk["settings"]["losses"]["del"]["type"] == "del"
    assert "mean over training seeds 0, 1" in (out / "tables.txt").read_text()
    summary = (out / "summary.md").read_text()
    assert "### synthetic: 4 problems" in summary and "| **del (mean)** |" in summary and "### svamp" in summary

    # again: finished runs are reused, and the numbers come out the same
    again = run_compare([base, ce, de], out=tmp_path / "out2", console=quiet(), **kwargs)
    assert {v["status"] for v in again["training"].values()} == {"reused"}
    for key in ("synthetic", "svamp"):
        assert again["evals"][key]["models"] == on_disk["evals"][key]["models"]
        assert again["evals"][key]["means"] == on_disk["evals"][key]["means"]

    # sampled answers over the same runs (eval settings never change what is trained: the runs are reused)
    r = run_cli("compare", ce, de, "--samples", 2, "--temperature", 1.0, "--no-transfer", "--out", tmp_path / "out4",
                "--seed", 0)
    assert r.exit_code == 0, r.output
    sampled = json.loads((tmp_path / "out4" / "compare.json").read_text())
    section = sampled["evals"]["synthetic"]
    assert section["settings"]["decoding"] == {"samples": 2, "temperature": 1.0, "top_p": 1.0, "seed": 0}
    for m in section["models"]:
        assert m["metrics"]["sampling"]["k"] == 2 and all(len(p["samples"]) == 2 for p in m["predictions"])
    assert "pass@2" in r.output

    # a finished run trained with another recipe is never silently reused
    with pytest.raises(UserError, match="different recipe .*train.learning_rate"):
        run_compare([ce, de], out=tmp_path / "out3", console=quiet(), seeds=[0], overrides=["train.learning_rate=0.5"],
                    no_transfer=True)


def test_refuses_recipes_that_differ_beyond_the_loss(tmp_path, tiny_recipes):
    _, ce, _, _ = tiny_recipes
    other = write_yaml(tmp_path / "recipes" / "other.yaml", {"base": "base.yaml", "loss": {"type": "dist2"},
                                                         "train": {"max_steps": 3, "learning_rate": 0.02}})
    with pytest.raises(UserError) as e:
        run_compare([ce, other], out=tmp_path / "out", console=quiet(), no_transfer=True)
    msg = str(e.value)
    assert "differ in more than their loss" in msg and "train.max_steps" in msg and "train.learning_rate" in msg
    assert not (tmp_path / "runs").exists()  # refused before any training
    twin = write_yaml(tmp_path / "recipes" / "ce2.yaml", {"base": "base.yaml", "loss": {"type": "ce"}})
    with pytest.raises(UserError, match="same loss"):
        resolve_contenders([ce, twin], [], quiet())


def test_arms_may_differ_in_how_numbers_are_written(tmp_path, tiny_recipes):
    """A formats comparison: CE on natural and on reversed numbers are two arms (each run is read back in its own
    form); the separator is not an arm's to change, and the same loss in the same form is one run twice."""
    _, ce, _, _ = tiny_recipes
    reverse = write_yaml(tmp_path / "recipes" / "ce_reversed.yaml", {
        "base": "base.yaml", "loss": {"type": "ce"}, "data": {"numbers": {"order": "reversed", "scope": "answer"}}})
    arms = resolve_contenders([ce, reverse], [], quiet())
    assert [a.recipe.data.numbers.order for a in arms] == ["natural", "reversed"]
    spaced = write_yaml(tmp_path / "recipes" / "ce_spaced.yaml", {
        "base": "base.yaml", "loss": {"type": "ce"}, "data": {"separator": " "}})
    with pytest.raises(UserError, match="data.separator"):
        resolve_contenders([ce, spaced], [], quiet())
    twin = write_yaml(tmp_path / "recipes" / "ce_reversed2.yaml", {
        "base": "base.yaml", "loss": {"type": "ce"}, "data": {"numbers": {"order": "reversed", "scope": "answer"}}})
    with pytest.raises(UserError, match="same loss .* and number form"):
        resolve_contenders([reverse, twin], [], quiet())


def test_cli_compare_refusal_exits_2(tmp_path, tiny_recipes):
    _, ce, _, _ = tiny_recipes
    other = write_yaml(tmp_path / "recipes" / "wide.yaml", {"base": "base.yaml", "loss": {"type": "del"},
                                                        "lora": {"r": 8}})
    r = run_cli("compare", str(ce), str(other), "--no-transfer", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "lora.r" in r.output and "Traceback" not in r.output
