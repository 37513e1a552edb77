"""Recipes, study files and --set values within bounds, and the recipe values that ended in tracebacks or in
misleading refusals (issue 36, items 6 and 7): each case provoked through the CLI, one paragraph, exit 2."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
from helpers import recipe_file, run_cli, write_yaml
from tiny import save_tiny

# An alias bomb: nine levels of nine aliases expand to 9**9 (387 million) strings in lora.target_modules.
BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
BOMB = "l0: &l0 q_proj\n" + BOMB + "lora:\n  target_modules: *l9\n"


def refused(r, *words: str) -> str:
    """Exit 2, no traceback, one paragraph saying every one of ``words``; returns it."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output, r.output
    text = r.output[r.output.index("error:"):].strip()
    assert "\n\n" not in text and r.output.count("error:") == 1, r.output
    flat = " ".join(text.split())
    for w in words:
        assert w in flat, (w, r.output)
    return flat


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def nested(depth: int) -> str:
    """A mapping ``depth`` levels deep, in block style."""
    return "".join(f"{'  ' * i}k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"


# ----------------------------------------------------------------------------- the file itself


@pytest.mark.parametrize("text, words", [
    (BOMB, ["defines the YAML anchor &l0 at line 1", "anchors and aliases are not accepted"]),
    ("base_lr: &lr 0.001\ntrain:\n  learning_rate: *lr\n", ["anchor &lr at line 1"]),
    ("defaults: {max_steps: 5}\ntrain:\n  <<: *defaults\n", ["alias *defaults at line 3"]),
    ("train: {seed: " + "[" * 10_000 + "]" * 10_000 + "}\n", ["nests lists or mappings more than 32 deep"]),
    ("data:\n  reasoning_gym:\n    options:\n" + "".join("  " * (i + 3) + f"k{i}:\n" for i in range(40))
     + "  " * 43 + "v: 1\n", ["more than 32 deep"]),
    ("# padding\n" * 110_000, ["larger than 1,000,000 bytes, too large for a recipe"]),
], ids=["alias-bomb", "anchor", "merge-key-alias", "10000-brackets", "deep-block-mapping", "over-1MB"])
def test_a_recipe_out_of_bounds_is_refused_before_it_is_built(tmp_path, text, words):
    path = write(tmp_path / "r.yaml", text)
    started = time.monotonic()
    r = run_cli("recipe", "check", path)
    refused(r, str(path), *words)
    assert time.monotonic() - started < 20  # nothing was expanded: the bomb alone would take minutes and gigabytes


def test_a_study_file_is_read_within_the_same_bounds(tmp_path):
    study = write(tmp_path / "s.study.yaml", "recipes: &r [a.yaml, b.yaml]\nalso: *r\n")
    refused(run_cli("study", study), str(study), "anchor &r", "not accepted")
    deep = write(tmp_path / "d.study.yaml", "recipes: " + "[" * 5000 + "]" * 5000 + "\n")
    refused(run_cli("study", deep), "more than 32 deep")


def test_the_shipped_recipes_and_studies_are_within_bounds():
    from helpers import REPO

    from delft.recipe.files import read_yaml

    for path in sorted(REPO.joinpath("recipes").rglob("*.yaml")):
        assert isinstance(read_yaml(path), dict), path


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("yaml_text, words", [
    ('output:\n  dir: "runs/a\\0b"\n', ["output.dir: holds a NUL character"]),
    ('model:\n  name: "models/x\\0y"\n', ["model.name: holds a NUL character"]),
    ('data:\n  reasoning_gym:\n    options: {a: "x\\0"}\n', ["data.reasoning_gym.options: holds a NUL character"]),
    ("output:\n  dir: " + "a" * 5000 + "\n", ["output.dir: is 5,0", "bytes long as an absolute path", "at most 1024"]),
    ("output:\n  dir: runs/" + "b" * 300 + "/x\n", ["output.dir: has a name of 300 bytes", "at most 200"]),
    ("train:\n  seed: 1.0e+30\n", ["train.seed: too large for a whole number", "got 1e+30"]),
    ("train:\n  seed: " + "9" * 40 + "\n", ["train.seed: too large for a whole number"]),
    ("train:\n  seed: 1099511627776\n", ["train.seed: Input should be less than or equal to 4294967295"]),
    ("train:\n  seed: -1\n", ["train.seed: Input should be greater than or equal to 0"]),
    ("train:\n  max_steps: 1.0e+30\n", ["train.max_steps: too large for a whole number"]),
    ("data:\n  synthetic:\n    n: -1.0e+300\n", ["data.synthetic.n: too large for a whole number"]),
    ("train:\n  snapshot_steps: [1, 1.0e+40]\n", ["train.snapshot_steps: too large for a whole number"]),
], ids=["nul-output-dir", "nul-model-name", "nul-in-options", "output-dir-5000", "output-dir-long-name",
        "seed-1e30", "seed-40-digits", "seed-2**40", "seed-negative", "max-steps-1e30", "n-minus-1e300",
        "snapshot-1e40"])
def test_a_value_no_run_can_use_is_refused_naming_its_key(tmp_path, yaml_text, words):
    path = write(tmp_path / "r.yaml", yaml_text)
    refused(run_cli("recipe", "check", path), str(path), "invalid recipe", *words)


@pytest.mark.parametrize("sets, words", [
    (["a.b=1", "a.b.c=1"], ["--set a.b.c=1 sets a key inside a.b, which an earlier --set made the value 1"]),
    (["train.seed=3", "train.seed.x=1"], ["inside train.seed"]),
    (["train={seed: 1}", "train.seed.deep.er=1"], ["inside train.seed"]),
    (["lora.target_modules=[&a q_proj, *a]"], ["--set lora.target_modules=[&a q_proj, *a]", "anchor &a"]),
    (["train.seed=" + "[" * 10_000], ["more than 32 deep"]),
    (["output.dir=runs/a\0b"], ["output.dir: holds a NUL character"]),
], ids=["value-then-key", "seed-then-key", "mapping-then-deeper", "alias", "deep", "nul"])
def test_set_values_are_refused_like_recipe_values(tmp_path, sets, words):
    path = write(tmp_path / "r.yaml", "train:\n  max_steps: 1\n")
    refused(run_cli("recipe", "check", path, *[x for s in sets for x in ("--set", s)]), *words)


def test_a_later_set_of_the_same_key_still_wins(tmp_path):
    path = write(tmp_path / "r.yaml", "train:\n  max_steps: 1\n")
    r = run_cli("recipe", "check", path, "--set", "train.seed=3", "--set", "train.seed=4")
    assert r.exit_code == 0 and "seed: 4" in r.output, r.output


# ----------------------------------------------------------------------------- output.dir as a symbolic link


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["missing", "loop"])
def test_an_output_dir_that_is_a_link_to_nothing_is_refused(tmp_path, tiny_model_dir, target):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "missing" if target == "missing" else link)
    recipe = recipe_file(tmp_path, tiny_model_dir, "run")
    refused(run_cli("train", recipe), f"{link} is a symbolic link to", "which does not exist (or loops)",
            "output.dir")
    assert link.is_symlink() and not (tmp_path / "missing").exists()


def test_force_never_replaces_a_run_through_a_link(tmp_path, tiny_model_dir, tiny_lora_run):
    real = tmp_path / "real"
    shutil.copytree(tiny_lora_run, real)
    before = tree(real)
    link = tmp_path / "run"
    link.symlink_to(real)
    recipe = recipe_file(tmp_path, tiny_model_dir, "run")
    refused(run_cli("train", recipe, "--force"), f"{link} is a symbolic link to {real}",
            "--force replaces only a real run directory, never through a link", f"output.dir: {real}")
    assert tree(real) == before and link.is_symlink()


# ----------------------------------------------------------------------------- a model's config.json numbers


@pytest.mark.parametrize("key, value, words", [
    ("rms_norm_eps", math.nan, ["sets rms_norm_eps to nan, which is not a finite number"]),
    ("num_hidden_layers", -1, ["sets num_hidden_layers to -1; it must be a whole number of 1 or more"]),
    ("hidden_size", 0, ["sets hidden_size to 0"]),
    ("rope_theta", math.inf, ["sets rope_theta to inf, which is not a finite number"]),
    ("num_attention_heads", 2.5, ["sets num_attention_heads to 2.5"]),
])
def test_a_model_config_number_is_named_not_blamed_on_the_recipe(tmp_path, key, value, words):
    model = save_tiny(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    text = refused(run_cli("train", recipe_file(tmp_path, model, "run")), f"{model / 'config.json'}", *words,
                   "model.name", "not a recipe setting")
    assert "learning_rate" not in text and "lora" not in text.lower()
    assert not (tmp_path / "run" / "delft_run.json").exists()


# ----------------------------------------------------------------------------- GRPO reward functions

REWARDS = '''
def one_positional(completion):
    return [0.0]

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def needs_more(completions, reference, **kwargs):
    return [0.0] * len(completions)

def fine(completions, **kwargs):
    return [0.0] * len(completions)
'''


@pytest.mark.parametrize("name, words", [
    ("one_positional", ["(completion)", "missing a required argument: 'completion'"]),
    ("no_kwargs", ["(prompts, completions)", "unexpected keyword argument 'completion_ids'"]),
    ("needs_more", ["missing a required argument: 'reference'"]),
])
def test_a_reward_function_with_the_wrong_signature_is_refused_before_any_model_loads(tmp_path, tiny_model_dir,
                                                                                      monkeypatch, name, words):
    pytest.importorskip("trl")
    write(tmp_path / "bounds_rewards.py", REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = recipe_file(tmp_path, tiny_model_dir, "run", train={"stage": "grpo"},
                         grpo={"num_generations": 2, "reward_functions": [f"bounds_rewards:{name}"]})
    refused(run_cli("train", recipe), "grpo.reward_functions", f"'bounds_rewards:{name}' has the signature", *words,
            "def reward(completions, **kwargs)")
    assert not (tmp_path / "run").exists()  # refused before the lock and the run directory


def test_a_reward_function_that_takes_trls_call_passes_the_check(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("trl")
    write(tmp_path / "bounds_rewards.py", REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "taken").write_text("a file")  # output.dir a file: the next check refuses, before any model
    recipe = write_yaml(tmp_path / "r.yaml", {
        "model": {"name": str(tiny_model_dir)}, "train": {"stage": "grpo"}, "output": {"dir": str(tmp_path / "taken")},
        "grpo": {"num_generations": 2, "reward_functions": ["bounds_rewards:fine"]}})
    refused(run_cli("train", recipe), "exists and is not a directory")
