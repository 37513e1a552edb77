"""QLoRA on the CPU is exact: a real nf4 run (validation and held-out accuracy after every step) computes, bit for
bit, the LoRA gradients of the same run on an fp32 model that carries the nf4-dequantised weights (delft's
pure-torch decoder, delft.export.nf4). bitsandbytes' flag for its bf16 CPU inference layout is forced on, so the
hazard it guards against (docs/platform.md: nf4 on the CPU) is exercised on every CPU, with or without AVX512-BF16.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import recipe_file

from delft.models.loading import nf4_layers
from delft.recipe.files import load_recipe
from delft.training import sft
from delft.training.stages import run_training

TRAIN = {"max_steps": 3, "eval_steps": 1, "accuracy_steps": 1, "accuracy_examples": 2, "save_steps": 10}


@pytest.fixture
def avx512bf16_forced(monkeypatch):
    """Every Linear4bit built from here on believes the CPU has AVX512-BF16 (bitsandbytes reads it per layer when
    the layer is built)."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)


def record_gradients(monkeypatch) -> list:
    """The real optimizer_step, then a copy of every trainable gradient (and the model's nf4 layers) appended to
    the returned list: one dict per step."""
    real, steps = sft.optimizer_step, []

    def step_and_copy(model, batches, loss, device):
        out = real(model, batches, loss, device)
        steps.append({"grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                      "nf4": nf4_layers(model)})
        return out

    monkeypatch.setattr(sft, "optimizer_step", step_and_copy)
    return steps


def dequantised_copy(model_dir: Path, out: Path) -> Path:
    """The model with every layer bitsandbytes quantises replaced by its nf4 round trip (double-quantised scales, as
    the run's), decoded by delft's pure-torch nf4 decoder, in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.export.nf4 import apply_nf4_roundtrip

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert apply_nf4_roundtrip(model, double_quant=True) == 14  # 2 layers x 7 projections
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def rows(run: Path, key: str) -> list:
    return [(r["step"], r[key]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def test_nf4_lora_gradients_after_evaluations_equal_the_dequantised_fp32_run(tmp_path, monkeypatch,
                                                                            avx512bf16_forced):
    from tiny import save_tiny

    model_dir = save_tiny(tmp_path / "wide", hidden=64)  # widths 64 and 128: what delft's nf4 on the CPU takes
    steps = record_gradients(monkeypatch)
    nf4_run = run_training(load_recipe(recipe_file(tmp_path, model_dir, name="nf4", quantization={"mode": "nf4"},
                                                   train=TRAIN, eval={"max_new_tokens": 4})))
    runs = {"nf4": steps[:]}
    steps.clear()
    reference = dequantised_copy(model_dir, tmp_path / "dequantised")
    fp32_run = run_training(load_recipe(recipe_file(tmp_path, reference, name="fp32", quantization={"mode": "none"},
                                                    train=TRAIN, eval={"max_new_tokens": 4})))
    runs["fp32"] = steps

    assert len(runs["nf4"]) == len(runs["fp32"]) == 3
    assert len(runs["nf4"][0]["nf4"]) == 14 and runs["fp32"][0]["nf4"] == []  # the nf4 run really ran on Linear4bit
    for step, (q, f) in enumerate(zip(runs["nf4"], runs["fp32"]), start=1):
        assert q["grads"].keys() == f["grads"].keys() and len(q["grads"]) == 28
        differ = [n for n in q["grads"] if not torch.equal(q["grads"][n], f["grads"][n])]
        assert not differ, f"step {step}: {len(differ)} of 28 LoRA gradients differ, e.g. {differ[0]}"
    for key in ("val_loss", "accuracy", "digit_accuracy"):  # the evaluations themselves: the same numbers
        assert rows(nf4_run, key) == rows(fp32_run, key) and len(rows(nf4_run, key)) == 3
    assert all(not m.support_avx512bf16_for_cpu for _, m in runs["nf4"][-1]["nf4"])  # how delft keeps it exact

