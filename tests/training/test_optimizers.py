"""train.optimizer, betas, momentum, lr_scheduler (wsd) and NEFTune: each steps a tiny run; the schedule's shape;
NEFTune's noise only while training, at its magnitude; refusals."""

import json

import pytest
import torch
from helpers import adapter_weights, interrupt_on_step, recipe_file, run_cli, write_yaml

from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.training.stages import run_training


def lrs(run) -> list[float]:
    return [r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r]


@pytest.mark.parametrize("train", [{"optimizer": "sgd", "momentum": 0.9, "learning_rate": 0.5},
                                   {"optimizer": "sgd", "learning_rate": 0.5},
                                   {"optimizer": "adamw", "betas": [0.8, 0.95]},
                                   {"lr_scheduler": "linear"}, {"lr_scheduler": "constant"},
                                   {"lr_scheduler": "wsd", "decay_ratio": 0.5}],
                         ids=["sgd-momentum", "sgd", "adamw-betas", "linear", "constant", "wsd"])
def test_each_optimizer_and_schedule_trains(tmp_path, tiny_model_dir, train):
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"warmup_ratio": 0.0, **train})))
    b = [v for k, v in adapter_weights(run).items() if "lora_B" in k]
    assert any(bool(x.abs().sum() > 0) for x in b)  # the optimizer moved the adapter (B starts at 0)
    assert len(lrs(run)) == 6


def test_the_schedules_have_their_shapes(tmp_path, tiny_model_dir):
    def lr_of(name, **train):
        path = recipe_file(tmp_path, tiny_model_dir, name=name, train={"max_steps": 10, "warmup_ratio": 0.2,
                                                                        "learning_rate": 1e-2, **train})
        return lrs(run_training(load_recipe(path)))

    constant = lr_of("constant", lr_scheduler="constant")
    assert constant[:2] == pytest.approx([5e-3, 1e-2]) and constant[2:] == pytest.approx([1e-2] * 8)  # after warmup
    wsd = lr_of("wsd", lr_scheduler="wsd", decay_ratio=0.3)
    assert wsd[:7] == pytest.approx([5e-3] + [1e-2] * 6)  # warmup 2, then stable for 5 (the rate after each step)
    assert wsd[7] < 1e-2 and wsd[-1] == pytest.approx(0.0, abs=1e-9)  # the last 3 steps decay to 0
    assert all(a >= b for a, b in zip(wsd[4:], wsd[5:]))


def test_sgd_without_momentum_keeps_no_state(tmp_path, tiny_model_dir):
    from rich.console import Console

    from delft.training.setup import build_model, build_optimizer, setup

    s = setup(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={"optimizer": "sgd"})))
    model, dtype, _ = build_model(s, Console(quiet=True))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(s, params, dtype)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.0


def test_the_paged_8bit_optimizer_is_refused_on_the_cpu(tmp_path, tiny_model_dir):
    """adamw_8bit runs on the CPU (tests/training/test_bitsandbytes_cpu.py); paged_adamw_8bit would run unpaged."""
    res = run_cli("train", recipe_file(tmp_path, tiny_model_dir, train={"optimizer": "paged_adamw_8bit"}))
    assert res.exit_code == 2 and "runs it unpaged" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("train,message", [
    ({"momentum": 0.9}, "momentum only applies to optimizer sgd"),
    ({"optimizer": "sgd", "betas": [0.8, 0.9]}, "betas only apply"),
    ({"decay_ratio": 0.2}, "decay_ratio only applies"),
    ({"betas": [0.9, 1.0]}, "betas must each be in"),
    ({"stage": "grpo", "optimizer": "sgd"}, "only apply to train.stage sft"),
    ({"stage": "grpo", "neftune_alpha": 5}, "only apply to train.stage sft"),
])
def test_optimizer_keys_that_do_not_apply_are_refused(tmp_path, train, message):
    with pytest.raises(UserError, match=message):
        load_recipe(write_yaml(tmp_path / "r.yaml", {"train": train}))


def test_neftune_adds_bounded_noise_only_in_train_mode(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from delft.training.neftune import add_neftune

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    emb = model.get_input_embeddings()
    clean = emb(ids).detach()
    add_neftune(model, 5.0)
    model.train()
    noisy = emb(ids).detach()
    bound = 5.0 / (6 * clean.shape[-1]) ** 0.5
    assert 0 < (noisy - clean).abs().max() <= bound + 1e-7
    assert (noisy - clean).abs().max() > bound / 2  # uniform over the whole range, not a tiny jitter
    model.eval()
    assert torch.equal(emb(ids), clean)


def test_a_neftune_run_resumes_exactly(tmp_path, tiny_model_dir, monkeypatch):
    train = {"neftune_alpha": 5.0}
    straight = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight", train=train)))
    plain = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="plain")))
    path = recipe_file(tmp_path, tiny_model_dir, name="resumed", train=train)
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    restore()
    run_training(load_recipe(path))
    a, b, c = adapter_weights(straight), adapter_weights(tmp_path / "resumed"), adapter_weights(plain)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    assert any(not torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # the noise changed the training
