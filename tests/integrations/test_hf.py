"""delft.integrations.hf: DigitTrainer's optimizer step equals delft's own loop, whatever the accumulation split."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, digit_targets, oracle_digits
from tiny import build_model, build_tokenizer

from delft.losses.registry import LOSS_TYPES
from delft.losses.terms import TERMS
from delft.numbers.tokens import NumberVocab

# 1 digit against 12: a per-micro-batch mean weighs these two very differently from delft's per-digit mean
TEXTS = ["Q: what is two plus one?\nA: 3", "Q: 123456.789 + 0.000012?\nA: 123456.789012"]
EIGHT = [f"Q: {a} + {b} =\nA: {a + b}" for a, b in ((1, 2), (45, 67), (100, 23), (9, 9), (1234, 5), (7, 70),
                                                    (3, 333), (12, 21))]


def encode(tok, texts):
    """Completion-only rows: the prompt (up to "A: ") is masked, as SFT pipelines train."""
    rows = []
    for t in texts:
        prompt, answer = t.split("A: ")
        p = tok.encode(prompt + "A: ", add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False)
        rows.append({"input_ids": p + a, "labels": [-100] * len(p) + a})
    return rows


def collate(rows):
    """Right-padded batch, labels -100 on padding (what delft.data.collate does)."""
    width = max(len(r["input_ids"]) for r in rows)
    pad = width - torch.tensor([len(r["input_ids"]) for r in rows])
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * int(p) for r, p in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [-100] * int(p) for r, p in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * int(p) for r, p in zip(rows, pad)])}


def trainer_step(model, tok, rows, batch_size: int, accumulation: int, digit_loss: dict, cls=None):
    """(the step's logged loss, ce, term, every parameter's gradient) of one DigitTrainer optimizer step."""
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from delft.integrations.hf import DigitTrainer

    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    args = TrainingArguments(output_dir="/tmp/delft-hf-test", per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, max_steps=1, logging_steps=1,
                             max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
                             disable_tqdm=True)
    trainer = (cls or DigitTrainer)(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collate,
                                    processing_class=tok, digit_loss=digit_loss, callbacks=[Grab()])
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    return log["loss"], log["ce"], log.get("digit_term", 0.0), grads  # no term logged for CE alone


def delft_step(model, tok, rows, digit_loss: dict, grad_accum: int = 1):
    """The same optimizer batch through delft's own loop (delft.training.step.optimizer_step), one micro-batch a row."""
    from delft.losses.loss import Loss
    from delft.recipe.schema import LossConfig
    from delft.training.step import optimizer_step

    opts = dict(digit_loss)
    loss = Loss.from_config(LossConfig(type=opts.pop("type"), **opts), NumberVocab.from_tokenizer(tok),
                            grad_accum=grad_accum)
    model.train()
    model.zero_grad()
    out = optimizer_step(model, [collate([r]) for r in rows], loss, "cpu")
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def setup():
    """A tiny Llama in float64: the comparisons then show the normalisation, not float32's summation order (the
    Trainer shuffles the micro-batches, so it adds gradients in another order than delft's loop)."""
    tok = build_tokenizer()
    return tok, build_model(tok, hidden=32, layers=2).double()


def assert_same_grads(a: dict, b: dict, rtol=1e-9, atol=1e-12):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def test_one_accumulated_step_equals_delfts_loop_and_not_a_per_micro_batch_mean(setup):
    tok, model = setup
    rows = encode(tok, TEXTS)
    vocab = NumberVocab.from_tokenizer(tok)
    digits = [vocab.places(r["labels"][1:]) for r in rows]
    assert [sum(p is not None for t in d for p in t) for d in digits] == [1, 12]
    spec = {"type": "del_prob", "weight": 0.5}
    loss, ce, term, grads = trainer_step(copy.deepcopy(model), tok, rows, 1, 2, spec)
    ref, ref_grads = delft_step(copy.deepcopy(model), tok, rows, spec)
    assert loss == pytest.approx(ref["loss"], rel=1e-6)
    assert (ce, term) == (pytest.approx(ref["ce"], rel=1e-5), pytest.approx(ref["term"], rel=1e-5))
    assert_same_grads(grads, ref_grads)
    # a per-micro-batch mean (what a compute_loss_func averaging each micro-batch does) is another loss
    m = copy.deepcopy(model)
    per_micro = sum(_full_logits_loss(m, tok, [r], spec) for r in rows) / 2
    per_micro.backward()
    assert per_micro.item() != pytest.approx(loss, rel=1e-3)
    differs = max(float((p.grad - grads[n]).abs().max()) for n, p in m.named_parameters() if p.grad is not None)
    assert differs > 1e-4


@pytest.mark.parametrize("kind", sorted(LOSS_TYPES))
def test_the_reported_loss_equals_an_independent_computation_from_the_logits(setup, kind):
    tok, model = setup
    rows = encode(tok, TEXTS)
    spec = {"type": kind, "weight": 0.7} if LOSS_TYPES[kind].has_term else {"type": kind}  # ce, dft: no weight
    loss, _, _, _ = trainer_step(copy.deepcopy(model), tok, rows, 2, 1, spec)
    assert loss == pytest.approx(float(_full_logits_loss(copy.deepcopy(model), tok, rows, spec)), rel=1e-5)


def _full_logits_loss(model, tok, rows, spec):
    """CE from full logits (torch) / labels + weight x the tests' oracle term / digits, over ``rows`` together."""
    batch = collate(rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    if spec["type"] == "dft":  # DFT (arXiv 2508.05629): each label's CE times its detached probability
        per_token = per_token * torch.exp(-per_token).detach()
    ce = per_token.sum() / int((labels != -100).sum())
    if spec["type"] in ("ce", "dft"):
        return ce
    oracle = oracle_digits(NumberVocab.from_tokenizer(tok))
    dt = digit_targets(labels, oracle)
    z = logits[dt.mask][:, list(oracle.digit_ids)]
    params = {"tau": 1.0} if spec["type"] == "dist2" else {}
    term = TERMS[spec["type"]](z, dt.targets, dt.weights, **params).sum() / len(dt.targets)
    return ce + spec["weight"] * term


def test_accumulation_splits_give_the_same_step(setup):
    """1 x 8 = 2 x 4 = 4 x 2: the same eight examples in one optimizer step, however they are split (in float64, so
    the summation order of differently padded micro-batches cannot hide a normalisation error)."""
    tok, model = setup
    rows = encode(tok, EIGHT)
    spec = {"type": "del", "weight": 0.3}
    runs = [trainer_step(copy.deepcopy(model), tok, rows, bs, ga, spec) for bs, ga in ((8, 1), (4, 2), (2, 4))]
    for loss, ce, term, grads in runs[1:]:
        assert loss == pytest.approx(runs[0][0], rel=1e-6) and ce == pytest.approx(runs[0][1], rel=1e-9)
        assert_same_grads(grads, runs[0][3], rtol=1e-9, atol=1e-12)
    ref, ref_grads = delft_step(copy.deepcopy(model), tok, rows, spec)
    assert runs[0][0] == pytest.approx(ref["loss"], rel=1e-6)  # the Trainer logs its loss in float32
    assert_same_grads(runs[0][3], ref_grads, rtol=1e-9, atol=1e-12)


def test_reference_normalisation_is_the_authors_per_micro_batch_scaling(setup):
    """'reference': CE per label of the step + weight x the micro-batch's own term mean, per micro-batch (the DEL
    authors' Trainer code), so a step is CE + weight x (sum of the micro-batch means)."""
    tok, model = setup
    rows = encode(tok, TEXTS)
    spec = {"type": "del", "weight": 0.2, "normalisation": "reference"}
    loss, _, _, grads = trainer_step(copy.deepcopy(model), tok, rows, 1, 2, spec)
    m = copy.deepcopy(model)
    labels_total = sum(int((collate([r])["labels"][:, 1:] != -100).sum()) for r in rows)
    want = 0
    for r in rows:
        micro = _full_logits_loss(m, tok, [r], {"type": "del", "weight": 0.2})
        ce_micro = _full_logits_loss(m, tok, [r], {"type": "ce"})
        n = int((collate([r])["labels"][:, 1:] != -100).sum())
        want = want + ce_micro * n / labels_total + (micro - ce_micro)
    want.backward()
    assert loss == pytest.approx(float(want), rel=1e-6)
    assert_same_grads(grads, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, rtol=1e-5, atol=1e-6)
    ref, ref_grads = delft_step(copy.deepcopy(model), tok, rows, spec, grad_accum=2)  # delft's own 'reference'
    assert ref["loss"] == pytest.approx(loss, rel=1e-6)
    assert_same_grads(grads, ref_grads)


def test_an_unknown_digit_loss_key_fails_with_its_name(setup):
    from delft.losses.modules import DigitLoss

    tok, _ = setup
    with pytest.raises(ValueError, match="wieght"):
        DigitLoss(tok, "del", wieght=0.3)


SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
from test_hf import EIGHT, encode, trainer_step
from tiny import build_model, build_tokenizer
tok = build_tokenizer()
loss, ce, term, grads = trainer_step(build_model(tok, hidden=32, layers=2), tok, encode(tok, EIGHT), {bs}, {ga},
                                     {{"type": "del_prob", "weight": 0.5}})
import torch.distributed as dist
if not dist.is_initialized() or dist.get_rank() == 0:
    torch.save({{"loss": loss, "ce": ce, "term": term, "grads": grads}}, {out!r})
"""


@pytest.mark.slow
def test_two_processes_under_torchrun_equal_one(tmp_path):
    """2 gloo processes x 2 per device x accumulation 2 = 1 process x 4 x 2: the same step, the same gradients."""
    results = {}
    for name, nproc, bs, ga in (("one", 1, 4, 2), ("two", 2, 2, 2)):
        script = tmp_path / f"{name}.py"
        out = tmp_path / f"{name}.pt"
        script.write_text(SCRIPT.format(tests=str(REPO / "tests"), bs=bs, ga=ga, out=str(out)))
        sys.path.insert(0, str(REPO / "tests" / "integrations"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'integrations'}:{REPO / 'tests'}",
               "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, **env})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        results[name] = torch.load(out)
    one, two = results["one"], results["two"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert (two["ce"], two["term"]) == (pytest.approx(one["ce"], rel=1e-5), pytest.approx(one["term"], rel=1e-5))
    # an all-reduce of two halves sums in another order than one process: float32 rounding of O(1) sums, ~1e-7
    assert_same_grads(two["grads"], one["grads"], rtol=1e-5, atol=1e-6)
    json.dumps({"loss": one["loss"]})  # plain floats came back


def test_its_peft_adapter_opens_in_delft_eval_inspect_and_export(tmp_path):
    from datasets import Dataset
    from helpers import run_cli
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, TrainingArguments

    from delft.integrations.hf import DigitTrainer

    tok = build_tokenizer()
    base, run = tmp_path / "base", tmp_path / "run"
    build_model(tok, hidden=32, layers=2).save_pretrained(base)
    tok.save_pretrained(base)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=str(run), per_device_train_batch_size=2, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", learning_rate=1e-2, disable_tqdm=True)
    trainer = DigitTrainer(model=policy, args=args, train_dataset=Dataset.from_list(encode(tok, EIGHT)),
                           data_collator=collate, processing_class=tok, digit_loss={"type": "ntl_was"})
    trainer.train()
    trainer.save_model(str(run))
    for cmd in (("eval", "--model", base, "--data", "synthetic", "--limit", "2", "--set", "eval.max_new_tokens=3", run),
                ("inspect", "--model", base, "--adapter", run, "--max-new-tokens", "3", "What is 2 + 3?"),
                ("export", run, "--out", tmp_path / "merged", "--dtype", "float32")):
        r = run_cli(*cmd)
        assert r.exit_code == 0, (cmd[0], r.output)
    assert (tmp_path / "merged" / "config.json").is_file()
