"""Contamination in delft study and delft compare: the scratch study's held-out set (a seed alone put 101 training
problems among its 300) now holds none; every model's training problems are counted in study.json and compare.json
with exact match on the unseen ones; a set that is mostly training data is refused before training unless
--allow-seen."""

import json

import pytest
from helpers import REPO, run_cli, write_arms, write_yaml
from rich.console import Console

from delft.data.pipeline import load_examples
from delft.data.sources import normalised_prompt
from delft.errors import UserError
from delft.experiments.compare import run_compare
from delft.experiments.study import _contenders, load_sets, run_study
from delft.experiments.study_file import eval_data, load_study
from delft.recipe.files import load_recipe

SCRATCH = REPO / "recipes" / "study" / "scratch.study.yaml"


def quiet() -> Console:
    return Console(width=200, record=True)


def prompts(examples) -> set[str]:
    return {normalised_prompt(e.prompt) for e in examples}


def test_the_scratch_studys_eval_sets_hold_none_of_its_training_problems():
    study = load_study(SCRATCH)
    cfg0 = _contenders(study, SCRATCH, [], None, quiet())[0].for_seed(study.seeds[0])
    training = prompts(load_examples(cfg0.data))
    assert cfg0.data.synthetic.n == 20000 and len(training) == 14141  # repeats: the space is small
    sets = {name: eval_data(name, spec, cfg0, None) for name, spec in study.evals.items()}
    by_seed_alone = [normalised_prompt(e.prompt) in training for e in load_examples(sets["held_out"], "eval.data")]
    assert sum(by_seed_alone) == 101  # the audit's count: what a moved seed alone left in
    loaded = load_sets(sets, SCRATCH, quiet(), cfg0.data)
    for name, (problems, _) in loaded.items():
        assert len(problems) == study.evals[name].limit
        assert not [p for p in problems if normalised_prompt(p.example.prompt) in training], name
    again = load_sets(sets, SCRATCH, quiet(), cfg0.data)
    assert [p.example.prompt for p in again["held_out"][0]] == [p.example.prompt for p in loaded["held_out"][0]]


def training_rows(rec) -> list[dict]:
    """The arms' training problems (write_arms: 24 synthetic sums) as prompt_completion rows."""
    data = load_recipe(rec / "ce.yaml").data
    return [{"prompt": e.prompt, "completion": e.completion} for e in load_examples(data)]


def fresh_rows(k: int) -> list[dict]:
    return [{"prompt": f"What is {700 + i} + {800 + i}?", "completion": str(1500 + 2 * i)} for i in range(k)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def arms(tmp_path, tiny_model_dir):
    return write_arms(tmp_path / "recipes", tiny_model_dir, tmp_path / "runs",
                      eval={"limit": 3, "max_new_tokens": 4, "bootstrap": 20})


def test_study_refuses_a_mostly_seen_set_before_training_and_allow_seen_lets_it_through(tmp_path, arms):
    seen = write_rows(tmp_path / "seen.jsonl", training_rows(arms)[:4] + fresh_rows(1))
    study = write_yaml(arms / "s.study.yaml", {
        "recipes": ["ce.yaml", "del.yaml"], "seeds": [0], "out": str(tmp_path / "out"),
        "evals": {"seen": {"source": str(seen), "format": "prompt_completion", "limit": 5}}})
    result = run_cli("study", study)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())
    assert "evals.seen: the eval set seen is mostly training data: 4 of its 5 problems" in text, text
    assert "--allow-seen" in text and not (tmp_path / "runs").exists()  # refused before any training
    cfg = load_recipe(arms / "ce.yaml")
    spec = load_study(study).evals["seen"]
    with pytest.raises(UserError, match="mostly training data"):
        load_sets({"seen": eval_data("seen", spec, cfg, None)}, study, quiet(), cfg.data)
    (problems, _), = load_sets({"seen": eval_data("seen", spec, cfg, None)}, study, quiet(), cfg.data,
                               allow_seen=True).values()
    assert len(problems) == 5


def test_compare_refuses_a_mostly_seen_transfer_set_before_training(tmp_path, arms):
    seen = write_rows(tmp_path / "seen.jsonl", training_rows(arms)[:3] + fresh_rows(2))
    result = run_cli("compare", arms / "ce.yaml", arms / "del.yaml", "--out", tmp_path / "out", "--transfer", seen,
                     "--transfer-format", "prompt_completion")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())
    assert "--transfer: the transfer set" in text and "is mostly training data: 3 of its 5 problems" in text, text
    assert not (tmp_path / "runs").exists()


def unseen_exact(model: dict, seen: list[int]) -> float:
    own = [p["exact"] for p in model["predictions"] if p["index"] not in seen]
    return pytest.approx(sum(own) / len(own))


@pytest.mark.slow
def test_compare_and_study_json_count_every_models_training_problems(tmp_path, arms):
    some = write_rows(tmp_path / "some.jsonl", training_rows(arms)[:2] + fresh_rows(3))
    report = run_compare([arms / "ce.yaml", arms / "del.yaml"], out=tmp_path / "cmp", console=quiet(),
                         transfer=str(some), transfer_format="prompt_completion", transfer_limit=5)
    for model in report["evals"]["synthetic"]["models"]:  # drawn without the training problems
        assert model["contamination"]["seen_in_training"] == 0, model["name"]
    base, *runs = report["evals"]["some"]["models"]
    assert base["contamination"]["seen_in_training"] == 0
    for model in runs:
        seen = model["contamination"]
        assert (seen["seen_in_training"], seen["seen_problems"], seen["unseen"]["n"]) == (2, [0, 1], 3)
        assert seen["unseen"]["exact_match"] == unseen_exact(model, [0, 1])
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["evals"]["some"]["models"][1][
        "contamination"]["seen_in_training"] == 2
    study = write_yaml(arms / "s.study.yaml", {
        "recipes": ["ce.yaml", "del.yaml"], "seeds": [0], "out": str(tmp_path / "study"),
        "evals": {"held_out": {"limit": 3, "max_new_tokens": 4},
                  "some": {"source": str(some), "format": "prompt_completion", "limit": 5, "max_new_tokens": 4},
                  "some_gold": {"source": str(some), "format": "prompt_completion", "limit": 5,
                                "mode": "teacher_forced"}}})
    on_disk = run_study(study, console=quiet())
    assert json.loads((tmp_path / "study" / "study.json").read_text())["evals"].keys() == on_disk["evals"].keys()
    counts = {key: [m["contamination"]["seen_in_training"] for m in sec["models"]]
              for key, sec in on_disk["evals"].items()}
    assert counts == {"held_out": [0, 0, 0], "some": [0, 2, 2], "some_gold": [0, 2, 2]}
    for model in on_disk["evals"]["some"]["models"][1:]:
        assert model["contamination"]["unseen"]["exact_match"] == unseen_exact(model, [0, 1])

