from pathlib import Path

import pytest
import yaml
from helpers import REPO

from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.recipe.files import parse_overrides

RECIPES = sorted(p for p in REPO.joinpath("recipes").rglob("*.yaml")
                 if not p.name.endswith(".study.yaml"))  # study files: tests/test_study.py


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_recipe_validates_and_says_how_to_run_it(path):
    recipe = load_recipe(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# delft "), f"{path} must start with the command that runs it"
    assert recipe.output.dir


def test_shipped_recipes_exist():
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


def test_typo_gets_did_you_mean(tmp_path):
    with pytest.raises(UserError) as e:
        load_recipe(write(tmp_path, "train:\n  learing_rate: 0.001\n"))
    assert "train.learing_rate: unknown key; did you mean learning_rate?" in str(e.value)
    assert str(tmp_path / "r.yaml") in str(e.value)


def test_unknown_section_gets_did_you_mean(tmp_path):
    with pytest.raises(UserError, match="quantizaton: unknown key; did you mean quantization"):
        load_recipe(write(tmp_path, "quantizaton:\n  mode: nf4\n"))


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(UserError) as e:
        load_recipe(write(tmp_path, "train:\n  batch_size: lots\n"))
    assert "train.batch_size" in str(e.value) and "'lots'" in str(e.value)


def test_impossible_values_are_errors(tmp_path):
    with pytest.raises(UserError, match="train.batch_size"):
        load_recipe(write(tmp_path, "train:\n  batch_size: 0\n"))
    with pytest.raises(UserError, match="min_digits"):
        load_recipe(write(tmp_path, "data:\n  synthetic:\n    min_digits: 5\n    max_digits: 2\n"))
    with pytest.raises(UserError, match="max_digits: Input should be less than or equal to 30"):
        load_recipe(write(tmp_path, "data:\n  synthetic:\n    max_digits: 31\n"))
    with pytest.raises(UserError, match=r"data.synthetic.ops.0: .*'copy'"):
        load_recipe(write(tmp_path, "data:\n  synthetic:\n    ops: [repeat]\n"))
    long = load_recipe(write(tmp_path, "data:\n  synthetic:\n    ops: [copy, '+']\n    min_digits: 20\n"
                                       "    max_digits: 30\n"))
    assert long.data.synthetic.ops == ["copy", "+"] and long.data.synthetic.max_digits == 30
    with pytest.raises(UserError, match="tau only applies"):
        load_recipe(write(tmp_path, "loss:\n  type: del\n  tau: 2.0\n"))
    with pytest.raises(UserError, match="source 'data.jsonl' is not 'synthetic', so it needs a format"):
        load_recipe(write(tmp_path, "data:\n  source: data.jsonl\n"))


def test_bad_yaml_says_where(tmp_path):
    with pytest.raises(UserError, match="not valid YAML at line 3"):
        load_recipe(write(tmp_path, "train:\n  batch_size: 4\n    seed: 1\n"))


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_overrides_parse_types_and_win(tmp_path):
    assert parse_overrides(["train.max_steps=50", "loss.type=ce", "lora.target_modules=[q_proj, v_proj]"]) == {
        "train": {"max_steps": 50}, "loss": {"type": "ce"}, "lora": {"target_modules": ["q_proj", "v_proj"]}}
    r = load_recipe(write(tmp_path, "train:\n  max_steps: 10\n  batch_size: 4\n"), ["train.max_steps=50"])
    assert r.train.max_steps == 50 and r.train.batch_size == 4


def test_override_typo_is_caught(tmp_path):
    with pytest.raises(UserError, match="did you mean max_steps"):
        load_recipe(write(tmp_path, "train: {}\n"), ["train.max_step=5"])
    with pytest.raises(UserError, match="KEY=VALUE"):
        load_recipe(write(tmp_path, "train: {}\n"), ["train.max_steps"])


def test_loss_weight_defaults_per_type(tmp_path):
    for kind, weight in {"del": 0.03, "ntl_was": 0.3, "ntl_mse": 0.3, "dist2": 0.1, "ce": 0.0}.items():
        r = load_recipe(write(tmp_path, f"loss:\n  type: {kind}\n"))
        assert r.loss.weight == weight
    assert load_recipe(write(tmp_path, "loss:\n  type: del\n  weight: 0.05\n")).loss.weight == 0.05


def test_eval_data_defaults_to_disjoint_synthetic_seed(tmp_path):
    r = load_recipe(write(tmp_path, "data:\n  synthetic:\n    seed: 3\n"))
    assert r.eval_data().synthetic.seed != r.data.synthetic.seed
    assert r.eval_data().val_size == 0


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(write(tmp_path, "train:\n  max_steps: 7\n"))
    again = load_recipe(write(tmp_path, yaml.safe_dump(r.to_dict())))
    assert again == r
