"""The real model: SmolLM2-135M-Instruct from PyPI (first use downloads ~93 MB and converts it once)."""


import pytest
from helpers import REPO

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


@pytest.mark.slow
@pytest.mark.smollm2
def test_quickstart_trains_real_smollm2_and_adapter_loads_with_peft(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from delft.models.sources import ensure_smollm2
    from delft.recipe import load_recipe
    from delft.training.trainer import run_training

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
