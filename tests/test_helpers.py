"""The shared fixtures are what they claim: delft reads them as a finished run and a digits-only model."""

import json

from helpers import DATA, adapter_weights

from delft.rundir import base_model, has_adapter, is_finished_run, read_info


def test_tiny_lora_run_is_a_finished_run_that_changes_the_model(tiny_lora_run, tiny_model_dir, tiny_tokenizer):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert is_finished_run(tiny_lora_run) and has_adapter(tiny_lora_run)
    assert base_model(tiny_lora_run) == str(tiny_model_dir) and read_info(tiny_lora_run)["architecture"]
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter_weights(tiny_lora_run).items())
    ids = tiny_tokenizer("What is 2 + 2?", return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, str(tiny_lora_run)).eval()(ids).logits
    assert (before - after).abs().max() > 1e-4


def test_digit_model_only_answers_with_digits(digit_model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(digit_model_path)
    model = AutoModelForCausalLM.from_pretrained(digit_model_path).eval()
    ids = tok("Q: 12 + 30?", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert set(tok.decode(out[0, ids.shape[1]:])) <= set("0123456789.")


def test_data_slices_are_in_the_real_formats():
    rows = [json.loads(ln) for ln in (DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(set(r) == {"question", "answer"} and "\n#### " in r["answer"] for r in rows)
    svamp = json.loads((DATA / "svamp.json").read_text())
    assert len(svamp) == 4 and {"Body", "Question", "Answer"} <= set(svamp[0])


def test_run_cli_passes_paths_and_returns_the_result(tmp_path):
    from helpers import run_cli, write_yaml

    path = write_yaml(tmp_path / "r.yaml", {"output": {"dir": str(tmp_path / "run")}, "train": {"max_steps": 3}})
    ok = run_cli("recipe", "check", path)  # a Path, str()-ed by the helper
    assert ok.exit_code == 0 and "max_steps: 3" in ok.output, ok.output
    missing = run_cli("recipe", "check", tmp_path / "missing.yaml")
    assert missing.exit_code == 2 and "Traceback" not in missing.output and "error:" in missing.output
