"""Recipe inheritance: a top-level ``base:`` key (path relative to the file), merged deep, the child wins."""

import pytest

from delft.errors import UserError
from delft.recipe.files import load_recipe, read_recipe_data, recipe_chain


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_child_extends_base_deeply_and_wins(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  max_steps: 10\n  batch_size: 4\nloss:\n  type: ce\n"
                                  "lora:\n  target_modules: [q_proj, v_proj]\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntrain:\n  max_steps: 20\nloss:\n  type: dist2\n"
                                           "lora:\n  target_modules: [o_proj]\n")
    r = load_recipe(child)
    assert r.train.max_steps == 20 and r.train.batch_size == 4  # deep merge: the sibling key survives
    assert r.loss.type == "dist2" and r.loss.weight == 0.1  # defaults resolve after the merge
    assert r.lora.target_modules == ["o_proj"]  # lists are replaced, not concatenated
    assert "base" not in read_recipe_data(child)


def test_base_path_is_relative_to_the_file_not_the_cwd(tmp_path, monkeypatch):
    write(tmp_path / "shared" / "common.yaml", "train:\n  seed: 7\n")
    child = write(tmp_path / "recipes" / "a" / "child.yaml", "base: ../../shared/common.yaml\n")
    monkeypatch.chdir(tmp_path / "recipes")
    assert load_recipe(child.relative_to(tmp_path / "recipes")).train.seed == 7


def test_chains_merge_in_order(tmp_path):
    write(tmp_path / "a.yaml", "train:\n  seed: 1\n  max_steps: 5\n  batch_size: 2\n")
    write(tmp_path / "b.yaml", "base: a.yaml\ntrain:\n  seed: 2\n  max_steps: 6\n")
    c = write(tmp_path / "c.yaml", "base: b.yaml\ntrain:\n  seed: 3\n")
    r = load_recipe(c)
    assert (r.train.seed, r.train.max_steps, r.train.batch_size) == (3, 6, 2)
    assert [p.name for p in recipe_chain(c)] == ["c.yaml", "b.yaml", "a.yaml"]


def test_overrides_win_over_the_whole_chain(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  max_steps: 10\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntrain:\n  max_steps: 20\n")
    assert load_recipe(child, ["train.max_steps=30"]).train.max_steps == 30


def test_cycles_are_errors(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    write(tmp_path / "self.yaml", "base: ./self.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        load_recipe(tmp_path / "self.yaml")


def test_missing_or_malformed_base(tmp_path):
    with pytest.raises(UserError, match="base recipe 'nope.yaml' does not exist"):
        load_recipe(write(tmp_path / "a.yaml", "base: nope.yaml\n"))
    with pytest.raises(UserError, match="base: must be a path"):
        load_recipe(write(tmp_path / "b.yaml", "base: [x.yaml]\n"))


def test_errors_in_the_base_name_the_merged_key(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  learing_rate: 0.1\n")
    with pytest.raises(UserError, match="did you mean learning_rate"):
        load_recipe(write(tmp_path / "child.yaml", "base: base.yaml\n"))
    write(tmp_path / "bad.yaml", "train: [\n")
    with pytest.raises(UserError, match="not valid YAML") as e:
        load_recipe(write(tmp_path / "child2.yaml", "base: bad.yaml\n"))
    assert "bad.yaml" in str(e.value)
