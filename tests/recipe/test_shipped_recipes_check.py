"""Every recipe and study file that comes with delft passes `delft recipe check` as shipped (issue 52, item 5); a
study file is checked as one, its recipes included; a study's recipe whose data lives in --data-dir says so."""

from __future__ import annotations

import pytest
from helpers import REPO, run_cli, write_yaml

SHIPPED = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "recipes").rglob("*.yaml"))


def test_the_walk_finds_the_recipes_and_the_study_files():
    assert "recipes/quickstart.yaml" in SHIPPED and "recipes/study/worked/ce.yaml" in SHIPPED
    assert sum(p.endswith(".study.yaml") for p in SHIPPED) >= 10


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_recipe_passes_recipe_check_as_shipped(path, monkeypatch):
    monkeypatch.chdir(REPO)
    r = run_cli("recipe", "check", path)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert ("valid study file" if path.endswith(".study.yaml") else "valid recipe") in said
    assert "unknown key" not in said


def test_a_study_file_is_checked_as_one_with_its_recipes(monkeypatch):
    monkeypatch.chdir(REPO)
    said = " ".join(run_cli("recipe", "check", "recipes/study/worked.study.yaml").output.split())
    assert "5 recipes x 3 seeds = 15 runs" in said and "eval set svamp: data file svamp.json does not exist" in said
    assert "gsm8k_train.jsonl is not here, so its rows were not checked" in said


def test_a_study_recipe_is_checked_with_its_data_dir_and_an_arm_of_no_study_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    data = tmp_path / "data"
    data.mkdir()
    missing = run_cli("recipe", "check", "recipes/study/worked/ce.yaml", "--data-dir", data)
    assert missing.exit_code == 2 and "neither in --data-dir" in missing.output
    (data / "gsm8k_train.jsonl").write_text('{"question": "1+1?", "answer": "1+1=2\\n#### 2"}\n')
    found = run_cli("recipe", "check", "recipes/study/worked/ce.yaml", "--data-dir", data)
    assert found.exit_code == 0 and "not here" not in found.output, found.output
    lone = write_yaml(tmp_path / "lone.yaml", {"data": {"source": "gsm8k_train.jsonl", "format": "gsm8k"}})
    refused = run_cli("recipe", "check", lone)
    assert refused.exit_code == 2 and "gsm8k_train.jsonl does not exist" in refused.output


def test_a_study_file_with_a_broken_recipe_is_refused(tmp_path):
    write_yaml(tmp_path / "a.yaml", {"loss": {"type": "ce"}})
    write_yaml(tmp_path / "b.yaml", {"loss": {"type": "del_prob", "wieght": 1}})
    study = write_yaml(tmp_path / "s.study.yaml", {"recipes": ["a.yaml", "b.yaml"], "out": "x",
                                                   "evals": {"syn": {"source": "synthetic", "limit": 8}}})
    r = run_cli("recipe", "check", study)
    assert r.exit_code == 2 and "wieght" in r.output
