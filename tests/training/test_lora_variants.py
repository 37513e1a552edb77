"""lora.use_dora, use_rslora, modules_to_save and init (gaussian, pissa, olora): a tiny run each, its adapter
loaded by peft on the original base (reproducing the trained model) and merged by delft export within tolerance."""

import json

import pytest
import torch
from helpers import interrupt_on_step, recipe_file, run_cli

from delft.recipe.files import load_recipe
from delft.training.stages import run_training

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def peft_logits(base_dir, run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        before = base(IDS).logits
        after = PeftModel.from_pretrained(base, str(run)).eval()(IDS).logits
    return before, after


def exported(run, out):
    res = run_cli("export", run, "--out", out, "--dtype", "float32")
    assert res.exit_code == 0, res.output
    return json.loads((out / "delft_export.json").read_text())


@pytest.mark.parametrize("lora", [{"use_dora": True}, {"use_rslora": True}, {"init": "gaussian"},
                                  {"modules_to_save": ["lm_head"]}],
                         ids=["dora", "rslora", "gaussian", "modules_to_save"])
def test_each_variant_trains_loads_in_peft_and_merges(tmp_path, tiny_model_dir, lora):
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, lora={"dropout": 0.0, **lora})))
    config = json.loads((run / "adapter_config.json").read_text())
    for key, value in lora.items():
        peft_key = {"init": "init_lora_weights"}.get(key, key)
        assert config[peft_key] == value, (peft_key, config[peft_key])
    before, after = peft_logits(tiny_model_dir, run)
    assert (after - before).abs().max() > 1e-4  # the adapter changes the model
    info = exported(run, tmp_path / "merged")
    assert info["passed"] and info["merge_abs_diff"] <= info["merge_tolerance"]


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_mutating_init_saves_an_adapter_for_the_original_base(tmp_path, tiny_model_dir, init, monkeypatch):
    """pissa and olora rewrite the base weights at init; what the run saves for users (its adapter, its snapshots)
    is converted so that the original base plus it equals the trained model; its checkpoints stay unconverted."""
    from peft import set_peft_model_state_dict
    from rich.console import Console
    from safetensors.torch import load_file

    from delft.rundir import checkpoint_path, snapshot_path
    from delft.training.setup import build_model, setup

    path = recipe_file(tmp_path, tiny_model_dir, lora={"dropout": 0.0, "init": init, "r": 4},
                       train={"save_steps": 3, "snapshot_steps": [3]})
    restore = interrupt_on_step(monkeypatch, 4)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    run = tmp_path / "run"
    # the trained model at step 3 as training had it: the mutated base and the checkpoint's (unconverted) adapter
    s = setup(load_recipe(path))
    model, _, _ = build_model(s, Console(quiet=True))
    set_peft_model_state_dict(model, load_file(str(checkpoint_path(run, 3) / "adapter_model.safetensors")))
    with torch.no_grad():
        trained = model.eval()(IDS).logits
    snap = snapshot_path(run, 3)
    assert json.loads((snap / "adapter_config.json").read_text())["r"] == 8  # converted: rank 2r, a plain LoRA
    before, after = peft_logits(tiny_model_dir, snap)
    torch.testing.assert_close(after, trained, atol=1e-4, rtol=1e-4)
    assert (after - before).abs().max() > 1e-3

    restore()
    run_training(load_recipe(path))  # resumes, finishes, converts the final adapter
    assert not (run / "initial_adapter").exists()  # only needed while training
    config = json.loads((run / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["init_lora_weights"] is True
    assert exported(run, tmp_path / "merged")["passed"]
