"""Peak GPU memory of a run (``delft recipe check RECIPE --plan``), estimated from the model's config.json alone.

No weights are loaded and torch is not imported. The estimate follows what delft's training step keeps alive:

  persistent   nf4 linear weights (0.5 byte/param + double-quantised scales), embeddings / output layer / norms
               in 16-bit, LoRA weights + gradients + AdamW moments in fp32 (peft keeps adapters in fp32)
  activations  with gradient checkpointing, every layer's input hidden state (batch x seq x hidden x 2 bytes)
  then the larger of two phases that never overlap:
    loss       one chunk of the output layer (chunk x vocab: bf16 logits, their fp32 copy, fp32 log-softmax) or
               Liger's fused linear CE, plus the final hidden states and the digit term: the hidden rows at
               number positions and the output rows of the number tokens (10 single digits; Llama-3: 1,110
               number tokens of 1-3 digits, with [rows x 1,110] logits and their per-character gather)
    backward   one layer recomputed and back-propagated (attention via SDPA, no seq x seq matrix), plus the
               bf16 copy bitsandbytes dequantises a 4-bit weight into

The per-token cost of the recomputed layer is calibrated on the H200 measurements of docs/gpu.md: LAYER_FIT on
the eager "chunked" rows (CALIBRATION), LIGER_LAYER_FIT on the Liger rows (LIGER_CALIBRATION); the other terms
are counted, not fitted. Everything is an upper bound on the data side: each
row padded to data.max_length and every position labelled.
"""

from __future__ import annotations

import math
import re

from delft.errors import UserError
from delft.losses.registry import fused_applies
from delft.planning.shapes import QWEN2, linear_shapes, lora_targets, model_shape, parameter_counts
from delft.recipe.schema import validate_recipe
from delft.recipe.train_section import EIGHT_BIT_OPTIMIZERS

GiB = 2**30


# nf4: 4 bits per weight; one absmax per block of 64 weights, itself quantised to 8 bits with an fp32 scale per 256
# blocks when double quantisation is on (bitsandbytes defaults), else an fp32 absmax per block.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


NF4_BYTES_NO_DQ = 0.5 + 4 / 64


MIN_8BIT_SIZE = 4096  # bitsandbytes' 8-bit AdamW keeps a smaller tensor's states in fp32 (its min_8bit_size)
LORA_BYTES = 4 + 4 + 8  # fp32 weight, its gradient, AdamW exp_avg and exp_avg_sq


# One decoder layer recomputed under checkpointing and back-propagated, bytes per token, as
# LAYER_H x hidden + LAYER_I x intermediate. Counted: ~20 H + 8 I of bf16 activations saved by the layer, 24 H + 4 I
# of fp32 input copies made by peft's LoRA (adapters are fp32), ~12 I of gradients in flight; = 44 H + 24 I.
# Scaled by LAYER_FIT, the one constant fitted to docs/gpu.md (see CALIBRATION; 1.3-1.45 all stay within 10 %).
LAYER_H, LAYER_I, LAYER_FIT = 44, 24, 1.4


# The layer constant of the fused path (Liger CE + RMSNorm / SwiGLU / RoPE kernels: models.apply_liger_layers),
# fitted to docs/gpu.md's three "Liger kernels, CE only" rows (LIGER_CALIBRATION): 0.6 gives -5 % to +4 %; anything in
# 0.55-0.65 stays within 7 %. Not the kernels' doing: counted on the CPU (bench/layer_memory.py) they change a
# layer's recompute + backward by 1-2 %, and that count alone predicts these rows within 7 %. The gap to LAYER_FIT
# is more likely the eager 7B x 4096 row it was fitted to
# (docs/performance.md#gpu-memory-delft-recipe-check-recipe---plan---gpu-memory-8gib).
LIGER_LAYER_FIT = 0.6


CUDA_CONTEXT = int(0.5 * GiB)  # CUDA context + cuBLAS workspace: outside torch.cuda.max_memory_allocated


ALLOCATOR_SLACK = 0.08  # caching-allocator fragmentation: reserved exceeds allocated by a few percent


# NCCL's communicator buffers on each GPU of a data-parallel run: outside torch's allocator, and a rough figure
# (they depend on the NCCL version, the number of channels and the topology).
NCCL_BUFFERS = int(0.25 * GiB)


# docs/gpu.md's probe runs its variants one after another in one process and keeps the previous variant's `out` (a
# CausalLMOutput whose bf16 logits are batch x seq x vocab) alive through the first "chunked" step, inside the
# peak window: "leftover_logits_of" names the variant that ran just before (gather, or ce for 7B x 4096).
CALIBRATION = [
    dict(model="0.5b", batch=8, seq=512, measured_gib=3.11, leftover_logits_of="gather"),
    dict(model="1.5b", batch=4, seq=1024, measured_gib=4.05, leftover_logits_of="gather"),
    dict(model="7b", batch=1, seq=1024, measured_gib=7.67, leftover_logits_of="gather"),
    dict(model="7b", batch=1, seq=4096, measured_gib=12.08, leftover_logits_of="ce"),
]


# docs/gpu.md's "Liger kernels (fused linear CE, rms_norm, swiglu, rope), CE only" rows: the peer delft's fused path
# must stay within 1.1x of. Two more probe runs of the same configs gave 2.32 (1.5B) and 8.51 GiB (7B).
LIGER_CALIBRATION = [
    dict(model="0.5b", batch=8, seq=512, measured_gib=1.11),
    dict(model="1.5b", batch=4, seq=1024, measured_gib=2.49),
    dict(model="7b", batch=1, seq=4096, measured_gib=7.87),
]


def dequantised_copy(lin: dict, d: int) -> int:
    """bitsandbytes dequantises a 4-bit weight to a 16-bit copy for each matmul (forward and backward): bytes."""
    return 2 * max(a * b for a, b in lin.values()) * d


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2  # auto = bf16 (fp16 where unsupported) on a GPU


def planned_nf4(recipe) -> bool:
    """Whether the run quantises its base to nf4 on a GPU (quantization auto: for LoRA, not full fine-tuning, and
    not under train.distributed fsdp, which refuses nf4: FSDP2 shards the base in the model dtype)."""
    return recipe.quantization_on("cuda") == "nf4"


def state_bytes(recipe) -> float:
    """The optimizer's state per trained parameter: AdamW's two moments in fp32, or in 8 bits with one fp32 absmax
    per block of 256 (the 8-bit AdamWs), or SGD's momentum buffer (none without momentum)."""
    t = recipe.train
    if t.optimizer == "sgd":
        return 4 if t.momentum > 0 else 0
    return 2 * (1 + 4 / 256) if t.optimizer in EIGHT_BIT_OPTIMIZERS else 8


def _optimizer_bytes_per_param(recipe) -> float:
    """Full fine-tuning: each weight's gradient (in the weights' dtype) and the optimizer's state."""
    return dtype_bytes(recipe.model.dtype) + state_bytes(recipe)


def _weight_bytes(s: dict, recipe) -> tuple[float, float, float]:
    """(nf4 weights, 16-bit or fp32 weights, the trained state in bytes: LoRA weights + gradients + AdamW states,
    or, fully fine-tuned, every weight's gradient + AdamW states)."""
    q, lo = recipe.quantization, recipe.lora
    d = dtype_bytes(recipe.model.dtype)
    nf4 = planned_nf4(recipe)
    small = 4 if nf4 and q.kbit_upcast else d  # prepare_model_for_kbit_training casts non-quantised weights to fp32
    linear_params, other_params = parameter_counts(s)
    weights_nf4 = linear_params * (NF4_BYTES if q.double_quant else NF4_BYTES_NO_DQ) if nf4 else 0
    weights_16 = other_params * small + (0 if nf4 else linear_params * d)
    if recipe.train.finetuning == "full":
        return weights_nf4, weights_16, (linear_params + other_params) * _optimizer_bytes_per_param(recipe)
    trained = lora_parameters(s, lo) * (LORA_BYTES - 8) + lora_state_bytes(s, recipe)
    return weights_nf4, weights_16, trained + saved_parameters(s, lo) * 4 * d


def lora_tensors(s: dict, lo) -> list[int]:
    """The sizes of one layer's LoRA tensors: A (r x in) and B (out x r) of each targeted projection, DoRA's
    magnitudes (out)."""
    targets = lora_targets(lo.target_modules)
    return [n for k, (a, b) in linear_shapes(s).items() if k in targets
            for n in (lo.r * a, lo.r * b, *((b,) if lo.use_dora else ()))]


def lora_parameters(s: dict, lo) -> int:
    """The LoRA adapters' parameters over all layers (A and B of each targeted projection, DoRA's magnitudes)."""
    return s["layers"] * sum(lora_tensors(s, lo))


def lora_state_bytes(s: dict, recipe) -> float:
    """The optimizer's state of every LoRA tensor: ``state_bytes`` each, except that the 8-bit AdamWs keep a tensor
    below MIN_8BIT_SIZE elements in fp32 (8 bytes), as bitsandbytes does."""
    per = state_bytes(recipe)
    eight = recipe.train.optimizer in EIGHT_BIT_OPTIMIZERS
    return s["layers"] * sum(n * (8 if eight and n < MIN_8BIT_SIZE else per) for n in lora_tensors(s, recipe.lora))


def saved_parameters(s: dict, lo) -> int:
    """Parameters of lora.modules_to_save's full trainable copies (embeddings, output layer)."""
    return sum(s["vocab"] * s["hidden"] for m in lo.modules_to_save if m in ("embed_tokens", "lm_head"))


def layer_bytes(s: dict, recipe, fused: bool, tokens: int) -> tuple[float, float]:
    """(activations kept for backward, the largest layer's recompute + backward working set) in bytes."""
    t, lo = recipe.train, recipe.lora
    H, L, I = s["hidden"], s["layers"], s["intermediate"]  # noqa: E741 - the shape's names
    d = dtype_bytes(recipe.model.dtype)
    lin = linear_shapes(s)
    layer_tok = (LIGER_LAYER_FIT if fused else LAYER_FIT) * (LAYER_H * H + LAYER_I * I) * d / 2  # fitted at 16 bit
    if lo.dropout > 0 and t.finetuning == "lora":  # peft's dropout keeps an fp32 copy of each LoRA input and its mask
        layer_tok += sum(a for k, (a, _) in lin.items() if k in lora_targets(lo.target_modules)) * 5
    if t.gradient_checkpointing:
        activations = L * tokens * H * d + tokens * H * d  # every layer's input + the embedding output
        layer_backward = tokens * layer_tok
    else:  # every layer keeps what it saves; about half the recompute + backward working set each
        activations = L * tokens * layer_tok * 0.5
        layer_backward = tokens * layer_tok * 0.5
    if planned_nf4(recipe):
        layer_backward += dequantised_copy(lin, d)
    if lo.use_dora and t.finetuning == "lora":  # DoRA's weight norm materialises W + BA of a layer in fp32
        layer_backward += max(a * b for a, b in lin.values()) * 4
    return activations, layer_backward


def loss_bytes(s: dict, recipe, fused: bool, tokens: int, n_lab: int) -> float:
    """The loss's working set in bytes: the output layer's logits (chunked or Liger's fused rows) and the digit rows."""
    H, V = s["hidden"], s["vocab"]
    d = dtype_bytes(recipe.model.dtype)
    q = recipe.quantization
    logit_d = 4 if planned_nf4(recipe) and q.kbit_upcast else d
    out_hidden = tokens * H * (d + 4) + n_lab * H * d  # final hidden (and the norm's fp32 input), labelled rows
    # upper bound: hidden rows at number positions gathered and upcast, the number tokens' output rows (and
    # their fp32 copy), their [rows x T] fp32 logits with the padded copy and per-character gather char_logits makes
    T_num = s["number_tokens"]
    digit_rows = n_lab * H * (d + 4) + T_num * H * (d + 4) + n_lab * T_num * 4 * 3
    if fused:
        rows = 2 ** math.ceil(math.log2(max(1, math.ceil(n_lab / math.ceil(V / H)))))
        loss = rows * V * (logit_d + 4) + n_lab * H * d + n_lab * 4
    else:
        loss = min(recipe.train.loss_chunk_size, n_lab) * V * (logit_d + (4 if logit_d != 4 else 0) + 4)
    return loss + out_hidden + digit_rows


def plan_memory(config: dict, recipe, fused: bool = False, label_fraction: float = 1.0) -> dict:
    """Components of the peak GPU memory of ``recipe``'s training step, in bytes (pure: no files, no torch).

    ``config`` is a config.json dict. ``fused`` = Liger's fused linear CE and layer kernels (``planned_fused``
    tells whether the recipe's run takes that path). ``label_fraction`` is the share of positions with a label
    (1.0: the upper bound). Keys: weights_nf4, weights_16bit, lora_optimizer, activations, loss, layer_backward,
    peak_allocated (what torch.cuda.max_memory_allocated reports), allocator_slack, cuda_context, total.
    """
    s = model_shape(config)
    tokens = recipe.train.batch_size * recipe.data.max_length
    n_lab = max(1, math.ceil(tokens * label_fraction))
    weights_nf4, weights_16, lora_opt = _weight_bytes(s, recipe)
    activations, layer_backward = layer_bytes(s, recipe, fused, tokens)
    loss = loss_bytes(s, recipe, fused, tokens, n_lab)
    peak = weights_nf4 + weights_16 + lora_opt + activations + max(loss, layer_backward)
    slack = peak * ALLOCATOR_SLACK
    comp = dict(weights_nf4=weights_nf4, weights_16bit=weights_16, lora_optimizer=lora_opt,
                activations=activations, loss=loss, layer_backward=layer_backward, peak_allocated=peak,
                allocator_slack=slack, cuda_context=CUDA_CONTEXT, total=peak + slack + CUDA_CONTEXT)
    return {k: int(v) for k, v in comp.items()}


def calibration_table() -> list[dict]:
    """plan_memory against every CALIBRATION row (the recipe docs/gpu.md's probe ran), in GiB."""
    rows = []
    for c in CALIBRATION:
        cfg = QWEN2[c["model"]]
        recipe = validate_recipe({
            "model": {"dtype": "bfloat16"}, "quantization": {"mode": "nf4", "double_quant": True},
            "lora": {"r": 16, "dropout": 0.0, "target_modules": "all-linear"},
            "data": {"max_length": c["seq"]},
            "train": {"batch_size": c["batch"], "loss_chunk_size": 1024, "fused_loss": "off",
                      "gradient_checkpointing": True},
            "loss": {"type": "del"}})
        est = plan_memory(cfg, recipe)
        leftover = c["batch"] * c["seq"] * cfg["vocab_size"] * 2
        estimate = est["peak_allocated"] / GiB
        rows.append(dict(**c, estimate_gib=round(estimate, 3), probe_leftover_gib=round(leftover / GiB, 3),
                         estimate_plus_leftover_gib=round(estimate + leftover / GiB, 3),
                         error=round((estimate + leftover / GiB) / c["measured_gib"] - 1, 4),
                         error_without_leftover=round(estimate / c["measured_gib"] - 1, 4),
                         components_gib={k: round(v / GiB, 3) for k, v in est.items()}))
    return rows


def liger_calibration_table(loss_type: str = "ce") -> list[dict]:
    """plan_memory with the fused path against docs/gpu.md's Liger CE-only rows, in GiB (``loss_type`` 'del': delft's
    DEL step on the same shapes, so estimate / measured is the predicted ratio to the Liger peer)."""
    rows = []
    for c in LIGER_CALIBRATION:
        recipe = validate_recipe({
            "model": {"dtype": "bfloat16"}, "quantization": {"mode": "nf4", "double_quant": True},
            "lora": {"r": 16, "dropout": 0.0, "target_modules": "all-linear"},
            "data": {"max_length": c["seq"]},
            "train": {"batch_size": c["batch"], "fused_loss": "on", "gradient_checkpointing": True},
            "loss": {"type": loss_type}})
        est = plan_memory(QWEN2[c["model"]], recipe, fused=True)
        estimate = est["peak_allocated"] / GiB
        rows.append(dict(**c, loss=loss_type, estimate_gib=round(estimate, 3),
                         ratio=round(estimate / c["measured_gib"], 4),
                         components_gib={k: round(v / GiB, 3) for k, v in est.items()}))
    return rows


def parse_memory(text: str) -> int:
    """'8GiB', '8 GB', '8000MiB', '7.5g' -> bytes (GiB when no unit is given)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"--gpu-memory {text!r} is not a memory size", "--gpu-memory",
                        "Write it like 8GiB, 24GB or 8000MiB.")
    value, prefix, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    if not prefix:
        if m.group(4):
            return int(value)  # plain bytes
        prefix, binary = "g", "i"
    power = "kmgt".index(prefix) + 1
    return int(value * (1024 if binary else 1000) ** power)


def planned_fused(recipe) -> tuple[bool, bool, str]:
    """(fused path?, liger-kernel installed?, warning) for the recipe's run on a GPU, by training's rule
    (delft.losses.registry.fused_applies). Installed is judged without importing it (no torch here). A run with
    train.fused_loss 'on' but no liger-kernel refuses to start: it is planned as the fused run it insists on."""
    import importlib.util

    liger = importlib.util.find_spec("liger_kernel") is not None
    fused, why = fused_applies(recipe.train.fused_loss, cuda=True, liger=liger)
    if why:
        return True, liger, f"train.fused_loss is 'on' but {why}: `delft train` will refuse to start"
    return fused, liger, ""


def per_gpu(est: dict, world_size: int) -> dict:
    """``plan_memory``'s numbers for each GPU of a ``world_size``-process data-parallel run
    (delft.training.distributed).

    Each rank runs the one-process step on its own micro-batch of train.batch_size, so its peak is the same; only
    NCCL's buffers come on top. The gradient all-reduce's flat fp32 copy of the LoRA gradients is made after the
    backward, when the activations are gone, so it does not raise the peak.
    """
    if world_size <= 1:
        return est
    return {**est, "nccl_buffers": NCCL_BUFFERS, "total": est["total"] + NCCL_BUFFERS}
