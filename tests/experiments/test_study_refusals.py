"""delft study refuses before the first training step: eval sets that cannot be loaded or scored (a bad file, one
without numeric answers, a hub dataset that cannot be reached), and its errors name `delft study` and the study
file's own keys, never `delft compare`'s options."""

import json
import os
import subprocess
import sys

import pytest
from helpers import run_cli, write_arms, write_yaml

from delft.errors import UserError
from delft.experiments.study_file import eval_data, load_study
from delft.recipe.files import load_recipe


@pytest.fixture
def arms(tmp_path, tiny_model_dir):
    """The recipes folder: ce and del (differing only in their loss) on a shared base, run in tmp_path/runs."""
    rec = write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs")
    return rec


def study_file(rec, evals: dict, recipes=("ce.yaml", "del.yaml"), name="s") -> str:
    return str(write_yaml(rec / f"{name}.study.yaml", {"recipes": list(recipes), "seeds": [0],
                                                       "out": str(rec.parent / "out"), "evals": evals}))


def flat(text: str) -> str:
    return " ".join(text.split())


def refused(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return flat(result.output)


def test_a_bad_eval_file_is_refused_before_training(tmp_path, arms):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": \n')
    out = refused(run_cli("study", study_file(arms, {
        "held_out": {"limit": 2, "max_new_tokens": 2},
        "broken": {"source": str(bad), "format": "gsm8k", "limit": 2}})))
    assert "bad.jsonl row 2 is not valid JSON" in out and "evals.broken" in out, out
    assert not (tmp_path / "runs").exists()  # refused before the first training step


def test_an_eval_file_without_numeric_answers_is_refused_before_training(tmp_path, arms):
    words = tmp_path / "words.jsonl"
    words.write_text("".join(json.dumps({"prompt": f"Say hello {i}", "completion": "hello"}) + "\n" for i in range(3)))
    out = refused(run_cli("study", study_file(arms, {
        "words": {"source": str(words), "format": "prompt_completion", "limit": 3, "mode": "teacher_forced"}})))
    assert "has no numeric answers" in out and "evals.words" in out and "eval.data" not in out, out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("split", [None, "validation"])
def test_an_unreachable_hub_eval_set_is_refused_before_training(tmp_path, arms, split):
    """No network (HF_HUB_OFFLINE, an empty cache, as tests/test_cli.py simulates it): refused at once, naming the
    split it would read (the study's `split`, by default "test"), and nothing trained."""
    spec = {"source": "nobody/nothing", "format": "gsm8k", "limit": 3, **({"split": split} if split else {})}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "-m", "delft", "study", study_file(arms, {"hub": spec})],
                         capture_output=True, text=True, env=env, timeout=300)
    out = flat(run.stderr)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert f"could not load hub dataset 'nobody/nothing' (split '{split or 'test'}')" in out, out
    assert "evals.hub.source" in out and "data.source" not in out.replace("evals.hub.source", ""), out
    assert not (tmp_path / "runs").exists()


def test_a_hub_eval_set_reads_its_split(arms):
    cfg = load_recipe(arms / "ce.yaml")
    hub = {"source": "openai/gsm8k", "format": "gsm8k", "limit": 3}
    study = load_study(study_file(arms, {"a": hub, "b": {**hub, "split": "train"}}))
    assert cfg.data.split == "train"  # the recipe's training split is not the eval set's
    assert eval_data("a", study.evals["a"], cfg, None).split == "test"
    assert eval_data("b", study.evals["b"], cfg, None).split == "train"
    assert "test" in type(study.evals["a"]).model_fields["split"].description
    for spec in ({"limit": 2, "split": "test"},  # synthetic
                 {"source": str(arms / "base.yaml"), "format": "gsm8k", "limit": 2, "split": "test"}):  # a file
        study = load_study(study_file(arms, {"x": spec}, name="x"))
        with pytest.raises(UserError, match="split.*hub dataset"):
            eval_data("x", study.evals["x"], cfg, None)


def test_study_errors_name_delft_study_and_its_own_keys(tmp_path, arms):
    evals = {"held_out": {"limit": 2, "max_new_tokens": 2}}
    cases = [
        (("ce.yaml", "ce.yaml"), "is given twice", "seeds"),
        (("base.yaml", "ce.yaml"), "study needs at least two recipes", "recipes"),
        (("ce.yaml", "missing.yaml"), "missing.yaml does not exist", "relative to the study file"),
    ]
    (arms / "ce2").mkdir()
    write_yaml(arms / "ce2" / "ce.yaml", {"base": "../base.yaml", "loss": {"type": "del"}})
    cases.append((("ce.yaml", "ce2/ce.yaml"), "recipes share the name ce", "recipes"))
    write_yaml(arms / "ce_again.yaml", {"base": "base.yaml", "loss": {"type": "ce"}})
    cases.append((("ce.yaml", "ce_again.yaml"), "resolve to the same loss", "recipes"))
    for i, (recipes, what, hint) in enumerate(cases):
        out = refused(run_cli("study", study_file(arms, evals, recipes, name=f"case{i}")))
        assert what in out and hint in out, out
        assert "delft study" in out or ".study.yaml" in out, out
        assert "delft compare" not in out and "--seed" not in out and "compare needs" not in out, out
    (tmp_path / "runs" / "ce-seed0").mkdir(parents=True)
    (tmp_path / "runs" / "ce-seed0" / "notes.txt").write_text("mine")
    out = refused(run_cli("study", study_file(arms, evals)))
    assert "ce-seed0 exists and is not a delft run" in out and "delft study" in out, out
    assert "compare" not in out, out
    assert (tmp_path / "runs" / "ce-seed0" / "notes.txt").read_text() == "mine"


def test_a_set_override_naming_a_set_the_study_lacks_is_one_paragraph():
    """--set evals.NAME.KEY on a NAME the file does not have would add a set of that one key (a synthetic set
    beside file-trained recipes, which crashed in validation): recipe check and study --plan refuse it by name."""
    from helpers import REPO

    worked = str(REPO / "recipes" / "study" / "worked.study.yaml")
    for args in (("recipe", "check", worked), ("study", worked, "--plan")):
        out = run_cli(*args, "--set", "evals.held_out.limit=16")
        assert out.exit_code == 2 and "Traceback" not in out.output, out.output
        said = " ".join(out.output.split())
        assert "names the eval set 'held_out'" in said and "its sets: gsm8k_gold, gsm8k, svamp" in said, said
    assert load_study(worked, ["evals.gsm8k.limit=16"]).evals["gsm8k"].limit == 16  # a set it has still changes
