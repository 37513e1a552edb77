"""delft.integrations.trl: DigitSFTTrainer inside TRL's SFTTrainer (completion-only, padding-free, packed, Liger)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, digit_targets, oracle_digits, run_cli
from tiny import build_model, build_tokenizer

from delft.losses.terms import TERMS
from delft.numbers.tokens import NumberVocab

ROWS = [{"prompt": f"Q: {a} + {b} =\nA: ", "completion": f"{a + b}"}
        for a, b in ((1, 2), (1234, 5678), (100, 5), (7, 8), (3, 39), (250, 250))]
SPEC = {"type": "del_prob", "weight": 0.5}


def sft_trainer(model, tok, rows=ROWS, spec=SPEC, **config):
    from datasets import Dataset
    from trl import SFTConfig

    from delft.integrations.trl import DigitSFTTrainer

    args = SFTConfig(**{"output_dir": "/tmp/delft-trl-test", "per_device_train_batch_size": 3, "max_steps": 1,
                        "logging_steps": 1, "report_to": [], "use_cpu": True, "save_strategy": "no",
                        "disable_tqdm": True, "max_length": None, **config})
    return DigitSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                           digit_loss=spec)


def first_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


@pytest.fixture
def setup():
    tok = build_tokenizer()
    return tok, build_model(tok, hidden=32, layers=2)


def test_completion_only_labels_and_the_loss_equal_an_independent_computation(setup):
    tok, model = setup
    trainer = sft_trainer(copy.deepcopy(model), tok)
    batch = first_batch(trainer)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    labels = batch["labels"][:, 1:]
    kept = [tok.decode([t for t in row.tolist() if t != -100]) for row in labels]
    assert all("Q:" not in k and k for k in kept)  # the prompts are masked: completion-only
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    oracle = oracle_digits(NumberVocab.from_tokenizer(tok))
    dt = digit_targets(labels, oracle)
    term = TERMS["del_prob"](logits[dt.mask][:, list(oracle.digit_ids)], dt.targets, dt.weights).sum()
    want = ce / int((labels != -100).sum()) + SPEC["weight"] * term / len(dt.targets)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def test_its_loss_equals_digit_trainers_on_the_same_batch(setup):
    from transformers import TrainingArguments

    from delft.integrations.hf import DigitTrainer

    tok, model = setup
    sft = sft_trainer(copy.deepcopy(model), tok)
    batch = first_batch(sft)
    sft.model.train()
    hf = DigitTrainer(model=copy.deepcopy(model), processing_class=tok, digit_loss=SPEC,
                      args=TrainingArguments(output_dir="/tmp/delft-hf-test", report_to=[], use_cpu=True))
    hf.model.train()
    assert float(sft.compute_loss(sft.model, dict(batch))) == pytest.approx(
        float(hf.compute_loss(hf.model, dict(batch))), rel=1e-6)


@pytest.mark.parametrize("layout", [{"padding_free": True}, {"packing": True, "packing_strategy": "bfd", "max_length": 512}],
                         ids=["padding_free", "packed"])
def test_padding_free_and_packed_batches_give_the_padded_batchs_loss(setup, layout):
    """The same six examples in one step: padded, padding-free or packed, one loss (runs break at sequence ends)."""
    tok, model = setup
    losses = []
    for config in ({}, layout):
        trainer = sft_trainer(copy.deepcopy(model), tok, per_device_train_batch_size=6, **config)
        batch = first_batch(trainer)
        trainer.model.train()
        losses.append(float(trainer.compute_loss(trainer.model, batch)))
        if config:
            assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch  # really one flattened row
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_training_logs_both_terms_and_its_adapter_opens_in_delft(setup, tmp_path):
    from peft import LoraConfig

    tok, model = setup
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    run = tmp_path / "run"
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)  # the adapter records its base path
    trainer = sft_trainer(policy, tok, max_steps=2, output_dir=str(run), learning_rate=1e-2)
    trainer.train()
    trainer.save_model(str(run))
    rows = [h for h in trainer.state.log_history if "loss" in h]
    assert len(rows) == 2 and all({"ce", "digit_term", "entropy"} <= set(r) for r in rows)
    for r in rows:
        assert r["loss"] == pytest.approx(r["ce"] + SPEC["weight"] * r["digit_term"], rel=1e-4)
    r = run_cli("eval", "--model", base, "--data", "synthetic", "--limit", "2", "--set", "eval.max_new_tokens=3", run)
    assert r.exit_code == 0, r.output
    r = run_cli("inspect", "--model", base, "--adapter", run, "--max-new-tokens", "3", "What is 2 + 3?")
    assert r.exit_code == 0, r.output
    r = run_cli("export", run, "--out", tmp_path / "merged", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "merged" / "config.json").is_file()


SMOL_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
from datasets import Dataset
from trl import SFTConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from delft.integrations.trl import DigitSFTTrainer
from delft.models.sources import resolve_model
if os.environ.get("TRITON_INTERPRET") == "1":
    from delft.losses.triton_cpu import patch_interpreter
    patch_interpreter()
path = resolve_model("smollm2-135m").path
tok = AutoTokenizer.from_pretrained(path)
rows = [{{"prompt": f"What is {{a}} + {{b}}? ", "completion": str(a + b)}} for a, b in ((12, 30), (7, 8), (123, 4), (9, 91))]
args = SFTConfig(output_dir={out!r}, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", max_length=32, disable_tqdm=True,
                 learning_rate=1e-4, use_liger_kernel={liger}, bf16=False)  # TRL defaults to bf16; the CPU trains fp32
trainer = DigitSFTTrainer(model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, digit_loss={{"type": "del_prob", "weight": 0.3}})
trainer.train()
print("LOGS " + json.dumps([h for h in trainer.state.log_history if "loss" in h]))
"""


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.parametrize("liger", [False, True], ids=["eager", "liger"])
def test_real_smollm2_trains_with_and_without_liger(tmp_path, liger):
    script = tmp_path / "smol.py"
    script.write_text(SMOL_SCRIPT.format(tests=str(REPO / "tests"), out=str(tmp_path / "out"), liger=liger))
    env = {**os.environ, "TRITON_INTERPRET": "1" if liger else "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    logs = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOGS "))[5:])
    assert len(logs) == 2, logs
    for row in logs:
        assert row["digit_term"] > 0 and row["ce"] > 0, logs
        assert row["loss"] == pytest.approx(row["ce"] + 0.3 * row["digit_term"], rel=1e-4)
