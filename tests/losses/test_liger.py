"""The Liger path (fused linear CE + RMSNorm/SwiGLU/RoPE kernels) against delft's pure-torch path.

There is no GPU here, so conftest sets TRITON_INTERPRET=1: Triton runs the very same Liger kernels on the
CPU (slowly, hence tiny shapes). On a GPU, bench/train_bench.py compares the two paths again (delft_del vs
delft_del_chunked).
"""

import json
import sys

import pytest
import torch
from helpers import adapter_weights, recipe_file
from tiny import build_model, build_tokenizer

from delft.losses.heads import resolve_fused
from delft.losses.loss import Loss
from delft.numbers.tokens import NumberVocab
from delft.recipe.files import load_recipe
from delft.training.stages import run_training


@pytest.fixture
def restore_rope(monkeypatch):
    """Liger's RoPE patch replaces a function in transformers' modeling files; put it back afterwards."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for module in (modeling_llama, modeling_qwen2):
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)


def build_arch(tok, arch: str):
    """The tiny test model as Llama, or as Qwen2 (q/k/v biases), the architecture of docs/gpu.md's peers."""
    if arch == "llama":
        return build_model(tok, hidden=32, layers=2)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=512, tie_word_embeddings=False,
                                        initializer_range=0.2, pad_token_id=tok.pad_token_id))


def test_interpreter_is_what_runs_here():
    assert resolve_fused("on", "cpu") is True  # liger-kernel installed (dev extra) + TRITON_INTERPRET=1
    assert resolve_fused("auto", "cpu") is False  # never the (slow) interpreter unless asked for


def test_fused_ce_and_digit_term_match_the_chunked_path():
    tok = build_tokenizer()
    vocab = NumberVocab.from_tokenizer(tok)
    torch.manual_seed(0)
    V, H = len(tok), 24
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(3, 11, H, requires_grad=True)
    labels = torch.randint(0, V, (3, 11))
    labels[0, :4] = -100
    labels[2, 5:] = torch.tensor(tok.convert_tokens_to_ids(list("12.507")))

    from helpers import del_step

    ref, ref_h, ref_w = del_step(vocab, hidden, head, labels, fused=False)
    out, g_h, g_w = del_step(vocab, hidden, head, labels, fused=True)
    assert ref.counts.digits >= 6 and out.counts.labels == ref.counts.labels == 29
    torch.testing.assert_close(out.ce, ref.ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.term, ref.term)
    torch.testing.assert_close(g_h, ref_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, ref_w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_liger_layer_kernels_give_the_eager_loss_and_gradients(restore_rope, arch):
    from delft.models.loading import apply_liger_layers, apply_lora
    from delft.recipe.schema import LoraConfig, LossConfig
    from delft.training.step import forward_sums, targets

    tok = build_tokenizer()
    vocab = NumberVocab.from_tokenizer(tok)
    ids = torch.tensor([tok.encode("12+7=19 and 305"), tok.encode("x=3.25 ok! 4000")])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "position_ids": torch.tensor([list(range(6)) + list(range(9)), list(range(15))])}  # one packed row

    def grads(liger: bool):
        model = build_arch(tok, arch)
        applied = apply_liger_layers(model) if liger else []
        torch.manual_seed(1)
        model = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0), gradient_checkpointing=True)
        model.train()
        loss_fn = Loss.from_config(LossConfig(type="del"), vocab, chunk_size=8, fused=liger)
        loss = loss_fn.combine(forward_sums(model, batch, loss_fn), loss_fn.count(targets(batch)))
        loss.backward()
        return applied, loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    modeling = sys.modules[type(build_arch(tok, arch)).__module__]
    classes = {k: v for k, v in vars(modeling).items() if isinstance(v, type)}
    _, ref_loss, ref = grads(False)
    applied, loss, got = grads(True)
    assert applied == ["rms_norm", "swiglu", "rope"]
    # the instance is patched, the modeling file's classes are not: models built later are built as usual
    assert {k: v for k, v in vars(modeling).items() if isinstance(v, type)} == classes
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    assert set(got) == set(ref) and len(ref) > 0
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_training_with_liger_on_equals_training_with_it_off(tmp_path, tiny_model_dir, restore_rope):
    runs = {}
    for mode in ("off", "on"):
        path = recipe_file(tmp_path, tiny_model_dir, name=mode, lora={"dropout": 0.0},
                           data={"synthetic": {"n": 16, "max_digits": 2}, "val_size": 2},
                           train={"max_steps": 3, "batch_size": 2, "eval_steps": 3, "fused_loss": mode})
        runs[mode] = run_training(load_recipe(path))
    curves = {m: [json.loads(ln)["loss"] for ln in (r / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in ln] for m, r in runs.items()}
    assert len(curves["on"]) == 3
    infos = {m: json.loads((r / "delft_run.json").read_text()) for m, r in runs.items()}
    assert {m: i["liger_kernels"] for m, i in infos.items()} == {"off": [], "on": ["rms_norm", "swiglu", "rope"]}
    # the CE path each run actually took, not the one it asked for
    assert {m: i["loss_path"] for m, i in infos.items()} == {"off": "chunked_ce", "on": "fused_linear_ce"}
    assert curves["on"] == pytest.approx(curves["off"], rel=1e-4)
    a, b = adapter_weights(runs["on"]), adapter_weights(runs["off"])
    # Adam divides by sqrt(v): an element whose gradient is near zero takes a step set by rounding, so a few
    # elements may differ by a small part of one step (lr 1e-2); a wrong kernel moves most of them by about lr.
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=5e-4, msg=lambda m: f"{k}: {m}")
        assert (a[k] - b[k]).abs().mean() < 1e-5, k
