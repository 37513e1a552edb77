"""QLoRA on the CPU is exact: a real nf4 run (validation and held-out accuracy after every step) computes, bit for
bit, the LoRA gradients of the same run on an fp32 model that carries the nf4-dequantised weights (delft's
pure-torch decoder, delft.export.nf4). bitsandbytes' flag for its bf16 CPU inference layout is forced on, so the
hazard it guards against (docs/platform.md: nf4 on the CPU) is exercised on every CPU, with or without AVX512-BF16.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import recipe_file, run_cli

from delft.models.loading import nf4_layers
from delft.recipe.files import load_recipe
from delft.training import sft
from delft.training.stages import run_training

TRAIN = {"max_steps": 2, "eval_steps": 1, "accuracy_steps": 1, "accuracy_examples": 2, "save_steps": 10}


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


def dequantised_copy(model_dir: Path, out: Path, layers: int = 14) -> Path:
    """The model with every layer bitsandbytes quantises replaced by its nf4 round trip (double-quantised scales, as
    the run's), decoded by delft's pure-torch nf4 decoder, in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.export.nf4 import apply_nf4_roundtrip

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert apply_nf4_roundtrip(model, double_quant=True) == layers  # every decoder layer's 7 projections
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def rows(run: Path, key: str) -> list:
    return [(r["step"], r[key]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def assert_same_gradients(nf4: list, fp32: list, tensors: int) -> None:
    for step, (q, f) in enumerate(zip(nf4, fp32), start=1):
        assert q["grads"].keys() == f["grads"].keys() and len(q["grads"]) == tensors
        differ = [n for n in q["grads"] if not torch.equal(q["grads"][n], f["grads"][n])]
        assert not differ, f"step {step}: {len(differ)} of {tensors} LoRA gradients differ, e.g. {differ[0]}"


@pytest.mark.slow
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

    assert len(runs["nf4"]) == len(runs["fp32"]) == 2
    assert len(runs["nf4"][0]["nf4"]) == 14 and runs["fp32"][0]["nf4"] == []  # the nf4 run really ran on Linear4bit
    assert_same_gradients(runs["nf4"], runs["fp32"], 28)
    for key in ("val_loss", "accuracy", "digit_accuracy"):  # the evaluations themselves: the same numbers
        assert rows(nf4_run, key) == rows(fp32_run, key) and len(rows(nf4_run, key)) == 2
    assert all(not m.support_avx512bf16_for_cpu for _, m in runs["nf4"][-1]["nf4"])  # how delft keeps it exact



@pytest.mark.slow
def test_an_nf4_cpu_run_exports_merged_as_it_trained(tmp_path, avx512bf16_forced):
    """`delft export --match-training` of an nf4 CPU run (evaluated after every step, so a repack would have been
    saved into the adapter): the merge check passes, and the merged fp32 model computes the logits of the nf4 model
    + adapter as bitsandbytes ran them; the plain merge does not."""
    from peft import PeftModel
    from tiny import save_tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.models.loading import load_model
    from delft.models.sources import ModelRef
    from delft.rundir import EXPORT_INFO

    model_dir = save_tiny(tmp_path / "wide", hidden=64)
    run = run_training(load_recipe(recipe_file(tmp_path, model_dir, name="nf4", quantization={"mode": "nf4"},
                                               train={**TRAIN, "learning_rate": 5e-2}, eval={"max_new_tokens": 4})))
    ids = AutoTokenizer.from_pretrained(run)("What is 12 + 30? 42", return_tensors="pt").input_ids
    nf4 = load_model(ModelRef(str(model_dir), str(model_dir), True), "cpu", torch.float32, "nf4")
    with torch.no_grad():
        base = nf4(ids).logits
        trained = PeftModel.from_pretrained(nf4, str(run)).eval()(ids).logits
    effect = (trained - base).abs().max()
    assert effect > 0.05  # the adapter moved the model: the comparisons below are about it

    merged = {}
    for how, flags in (("matched", ["--match-training"]), ("plain", [])):
        res = run_cli("export", run, "--out", tmp_path / how, "--dtype", "float32", *flags)
        assert res.exit_code == 0, res.output
        info = json.loads((tmp_path / how / EXPORT_INFO).read_text())
        assert info["passed"] is True
        model = AutoModelForCausalLM.from_pretrained(tmp_path / how, dtype=torch.float32).eval()
        with torch.no_grad():
            merged[how] = (model(ids).logits - trained).abs().max()
    assert info["roundtripped_layers"] == 0 and json.loads((tmp_path / "matched" / EXPORT_INFO).read_text())[
        "roundtripped_layers"] == 14
    assert merged["matched"] < 1e-4 * effect  # fp32 summation order only: the model as it trained
    assert merged["plain"] > 100 * merged["matched"]  # the unquantised base is another model


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_nf4_lora_gradients_around_a_validation_equal_the_dequantised_fp32_run(tmp_path, monkeypatch,
                                                                                    avx512bf16_forced):
    """The same on the real SmolLM2-135M (30 layers, widths 576 and 1536): 5 steps, validated at step 3."""
    from delft.models.sources import ensure_smollm2

    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    common = ["train.max_steps=5", "train.eval_steps=3", "train.save_steps=10", "train.batch_size=4",
              "data.synthetic.n=48", "data.val_size=4", "model.device=cpu"]
    steps = record_gradients(monkeypatch)
    nf4_run = run_training(load_recipe(quickstart, [*common, "quantization.mode=nf4", f"output.dir={tmp_path / 'nf4'}"]))
    nf4 = steps[:]
    steps.clear()
    reference = dequantised_copy(ensure_smollm2(), tmp_path / "dequantised", layers=210)
    fp32_run = run_training(load_recipe(quickstart, [*common, "quantization.mode=none", f"model.name={reference}",
                                                     f"output.dir={tmp_path / 'fp32'}"]))
    assert len(nf4) == len(steps) == 5 and len(nf4[0]["nf4"]) == 210
    assert_same_gradients(nf4, steps, 420)
    assert rows(nf4_run, "val_loss") == rows(fp32_run, "val_loss") and len(rows(nf4_run, "val_loss")) == 2
