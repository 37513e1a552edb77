"""train.finetuning: full (every weight trained, a standalone model saved) and model.init: scratch (random weights,
delft's character-level tokenizer), on tiny models; the real SmolLM2-135M run is in tests/test_slow_smollm2.py."""

import json
from pathlib import Path

import pytest
import torch
from helpers import interrupt_on_step, recipe_file, run_cli, write_yaml
from safetensors.torch import load_file

from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.rundir import is_finished_run, latest_checkpoint, read_info, snapshot_path
from delft.training.stages import run_training

FULL = {"finetuning": "full", "learning_rate": 3e-3}


def model_weights(run_dir) -> dict:
    return {k: v for f in sorted(run_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def scratch_recipe(tmp_path, name="scratch", **train):
    return write_yaml(tmp_path / f"{name}.yaml", {
        "model": {"init": "scratch", "architecture": {"hidden_size": 32, "layers": 2, "heads": 2,
                                                      "intermediate_size": 64, "context": 48}},
        "data": {"synthetic": {"n": 48, "max_digits": 2, "ops": ["+"]}, "max_length": 40, "val_size": 8},
        "train": {"finetuning": "full", "max_steps": 6, "batch_size": 4, "learning_rate": 3e-3, "logging_steps": 1,
                  "eval_steps": 3, "save_steps": 3, "warmup_ratio": 0.0, **train},
        "eval": {"limit": 4, "batch_size": 4, "bootstrap": 10, "max_new_tokens": 4},
        "output": {"dir": str(tmp_path / name)}})


def test_full_finetuning_changes_every_weight_and_saves_a_model(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train=FULL)))
    assert not (run / "adapter_config.json").exists() and is_finished_run(run)
    info = read_info(run)
    assert info["finetuning"] == "full" and info["status"] == "completed"
    before, after = model_weights(tiny_model_dir), model_weights(run)
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == []  # embeddings, norms, attention, MLP, output layer: all trained
    model = AutoModelForCausalLM.from_pretrained(run)  # a standalone model: no peft, no base needed
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in after.values())


def test_full_finetuning_resume_equals_uninterrupted(tmp_path, tiny_model_dir, monkeypatch):
    straight = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight", train=FULL)))
    path = recipe_file(tmp_path, tiny_model_dir, name="resumed", train=FULL)
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    ckpt = latest_checkpoint(tmp_path / "resumed")
    assert ckpt.name == "step-000004" and (ckpt / "model.safetensors").is_file()
    restore()
    run_training(load_recipe(path))
    a, b = model_weights(straight), model_weights(tmp_path / "resumed")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_a_scratch_run_trains_from_random_weights_with_single_digit_tokens(tmp_path):
    from transformers import AutoTokenizer

    from delft.models.scratch import base_name
    from delft.numbers.tokens import NumberVocab

    recipe = load_recipe(scratch_recipe(tmp_path, snapshot_steps=[2, 4]))
    run = run_training(recipe)
    tok = AutoTokenizer.from_pretrained(run)
    assert [tok.decode([i]) for i in tok("1234")["input_ids"]] == ["1", "2", "3", "4"]
    assert len(NumberVocab.from_tokenizer(tok).ids) == 10
    init = base_name(recipe)  # the untrained model, the "base" eval and study compare with
    before, after = model_weights(Path(init)), model_weights(run)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert read_info(run)["init"] == "scratch"
    for step in (2, 4):  # the learning-curve snapshots: models of their own, between the init and the end
        snap = model_weights(snapshot_path(run, step))
        assert any(not torch.equal(snap[k], after[k]) for k in snap)
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]
    res = run_cli("eval", tmp_path / "scratch.yaml", run, snapshot_path(run, 2))
    assert res.exit_code == 0, res.output
    assert "exact match" in res.output


def test_the_same_seed_gives_the_same_init_and_another_seed_another(tmp_path):
    from delft.models.scratch import base_name

    a = base_name(load_recipe(scratch_recipe(tmp_path)))
    b = base_name(load_recipe(scratch_recipe(tmp_path), ["train.seed=1"]))
    assert a == base_name(load_recipe(scratch_recipe(tmp_path))) and a != b
    wa, wb = model_weights(Path(a)), model_weights(Path(b))
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])


def test_export_copies_and_verifies_a_fully_fine_tuned_run(tmp_path, tiny_model_dir):
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train=FULL)))
    res = run_cli("export", run, "--out", tmp_path / "out", "--dtype", "float32")
    assert res.exit_code == 0, res.output
    info = json.loads((tmp_path / "out" / "delft_export.json").read_text())
    assert info["passed"] and info["merge"] == "full model" and info["max_abs_diff"] <= 1e-4
    assert info["adapter_effect"] > 1e-3  # training moved the logits away from the starting weights
    a, b = model_weights(run), model_weights(tmp_path / "out")
    assert all(torch.equal(a[k], b[k]) for k in a)
    res = run_cli("export", run, "--out", tmp_path / "out2", "--match-training")
    assert res.exit_code == 2 and "fully fine-tuned" in res.output


def test_bf16_weights_keep_fp32_optimizer_states(tmp_path, tiny_model_dir):
    """One optimizer step with delft's builders, read by the prepared GPU check's own helper."""
    recipe = load_recipe(recipe_file(tmp_path, tiny_model_dir, train=FULL, model={"name": str(tiny_model_dir),
                                                                                    "dtype": "bfloat16"}))
    dtypes = _gpu_check().moment_dtypes(recipe)
    assert dtypes["weights"] == "torch.bfloat16" and dtypes["moments"] == ["torch.float32"]


def _gpu_check():
    """bench/gpu_full_ft.py as a module (bench/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_full_ft.py"
    spec = importlib.util.spec_from_file_location("gpu_full_ft", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("changes,message", [
    ({"model": {"init": "scratch"}}, "set train.finetuning: full"),
    ({"train": {"finetuning": "full"}, "quantization": {"mode": "nf4"}}, "nf4 weights cannot be trained"),
    ({"train": {"finetuning": "full"}, "model": {"adapter": "runs/x"}}, "drop one of them"),
    ({"train": {"finetuning": "full", "stage": "grpo"}}, "LoRA policy"),
    ({"model": {"architecture": {"layers": 2}}}, "only apply to init: scratch"),
    ({"model": {"init": "scratch", "architecture": {"hidden_size": 30, "heads": 4}}, "train": {"finetuning": "full"}},
     "does not divide"),
    ({"model": {"init": "scratch", "architecture": {"context": 32}}, "train": {"finetuning": "full"},
      "data": {"max_length": 64}}, "longer than model.architecture.context"),
])
def test_recipe_refuses_what_cannot_train(tmp_path, changes, message):
    path = write_yaml(tmp_path / "r.yaml", changes)
    with pytest.raises(UserError, match=message):
        load_recipe(path)


def test_8bit_adamw_fully_fine_tunes_on_the_cpu(tmp_path, tiny_model_dir):
    path = recipe_file(tmp_path, tiny_model_dir, train={**FULL, "optimizer": "adamw_8bit", "max_steps": 2})
    res = run_cli("train", path)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert json.loads((tmp_path / "run" / "delft_run.json").read_text())["status"] == "completed"


def test_the_prepared_gpu_check_builds_valid_full_fine_tuning_recipes(tmp_path):
    """bench/gpu_full_ft.py waits for a session with a GPU: its recipes must still resolve when one comes."""
    bench = _gpu_check()
    for device, dtype in (("cuda", "bfloat16"), ("cpu", "float32")):
        r = load_recipe(bench.RECIPE, bench.overrides(device, "adamw_8bit", 20, tmp_path / "run"))
        assert (r.model.device, r.model.dtype, r.train.finetuning, r.train.optimizer) == (device, dtype, "full",
                                                                                          "adamw_8bit")
        assert r.model.init == "scratch" and r.model.architecture.hidden_size == bench.ARCHITECTURE["hidden_size"]
