"""``delft recipe check RECIPE --plan``: peak GPU memory of a run, estimated from the model's config.json alone.

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
from pathlib import Path
from typing import Optional

from delft.errors import UserError

GiB = 2**30


# nf4: 4 bits per weight; one absmax per block of 64 weights, itself quantised to 8 bits with an fp32 scale per 256
# blocks when double quantisation is on (bitsandbytes defaults), else an fp32 absmax per block.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


NF4_BYTES_NO_DQ = 0.5 + 4 / 64


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
# is more likely the eager 7B x 4096 row it was fitted to (docs/performance.md#gpu-memory-delft-recipe-check-recipe---plan---gpu-memory-8gib).
LIGER_LAYER_FIT = 0.6


CUDA_CONTEXT = int(0.5 * GiB)  # CUDA context + cuBLAS workspace: outside torch.cuda.max_memory_allocated


ALLOCATOR_SLACK = 0.08  # caching-allocator fragmentation: reserved exceeds allocated by a few percent


# NCCL's communicator buffers on each GPU of a data-parallel run: outside torch's allocator, and a rough figure
# (they depend on the NCCL version, the number of channels and the topology).
NCCL_BUFFERS = int(0.25 * GiB)


# SmolLM2-135M-Instruct's shape, so the alias plans without fetching anything.
SMOLLM2_CONFIG = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                      tie_word_embeddings=True)


# Measured on one H200 (docs/gpu.md, "chunked CE + 10-row digit term" rows): torch max allocated.
QWEN2 = {
    "0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}


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


LORA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# config key under which run_plan passes the tokenizer's number-token count (delft.numbers.tokens); 10 when unknown
NUMBER_TOKENS = "delft_number_tokens"


def model_shape(config: dict) -> dict:
    """The numbers the estimate needs, from a config.json dict (nested text_config and GPT-style names too)."""
    cfg = config
    if "hidden_size" not in cfg and "n_embd" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                   cfg["text_config"].get("tie_word_embeddings"))}

    def get(*names, default=None):
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        return default

    H = get("hidden_size", "n_embd", "d_model")
    L = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    V = get("vocab_size")
    if not all(isinstance(x, int) and x > 0 for x in (H, L, heads, V)):
        raise UserError("the model's config.json lacks hidden_size / num_hidden_layers / num_attention_heads / "
                        "vocab_size", "model.name", "--plan supports decoder-only transformer configs.")
    kv = get("num_key_value_heads", "n_head_kv", default=heads)
    head_dim = get("head_dim", default=H // heads)
    inter = get("intermediate_size", "n_inner", "ffn_dim", default=4 * H)
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=1) or 1
    return dict(model_type=cfg.get("model_type", "?"), hidden=H, layers=L, heads=heads, kv_heads=kv,
                head_dim=head_dim, intermediate=inter, vocab=V, experts=int(experts),
                tied=bool(get("tie_word_embeddings", default=False)),
                number_tokens=int(config.get(NUMBER_TOKENS, 10)),
                qkv_bias=bool(get("attention_bias", default=cfg.get("model_type") == "qwen2")))


def _linears(s: dict) -> dict:
    """(in, out) of each projection of one layer."""
    H, q, kv, I = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["intermediate"]
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}


def dequantised_copy(lin: dict, d: int) -> int:
    """bitsandbytes dequantises a 4-bit weight to a 16-bit copy for each matmul (forward and backward): bytes."""
    return 2 * max(a * b for a, b in lin.values()) * d


def _lora_targets(target_modules) -> tuple[str, ...]:
    if target_modules == "all-linear":
        return LORA_NAMES
    names = tuple(n for n in LORA_NAMES if any(t == n or t.endswith("." + n) for t in target_modules))
    return names or LORA_NAMES  # unknown names (other architectures): count as if all projections


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2  # auto = bf16 (fp16 where unsupported) on a GPU


def planned_nf4(recipe) -> bool:
    """Whether the run quantises its base to nf4 on a GPU (quantization auto: for LoRA, not full fine-tuning)."""
    q = recipe.quantization.mode
    return q == "nf4" or (q == "auto" and recipe.train.finetuning == "lora")


def _state_bytes(recipe) -> float:
    """The optimizer's state per trained parameter: AdamW's two moments in fp32, or in 8 bits with one fp32 absmax
    per block of 256 (the 8-bit AdamWs), or SGD's momentum buffer (none without momentum)."""
    t = recipe.train
    if t.optimizer == "sgd":
        return 4 if t.momentum > 0 else 0
    return 2 * (1 + 4 / 256) if t.optimizer in ("adamw_8bit", "paged_adamw_8bit") else 8


def _optimizer_bytes_per_param(recipe) -> float:
    """Full fine-tuning: each weight's gradient (in the weights' dtype) and the optimizer's state."""
    return _dtype_bytes(recipe.model.dtype) + _state_bytes(recipe)


def parameter_counts(s: dict) -> tuple[int, int]:
    """(parameters in the linear projections, all the others: embeddings, output layer, norms, qkv biases) of a
    ``model_shape``."""
    H, L, V = s["hidden"], s["layers"], s["vocab"]
    lin = _linears(s)
    mlp = sum(a * b for k, (a, b) in lin.items() if k.endswith(("gate_proj", "up_proj", "down_proj")))
    linear_params = L * (sum(a * b for a, b in lin.values()) + (s["experts"] - 1) * mlp)
    other_params = V * H * (1 if s["tied"] else 2) + L * 2 * H + H
    if s["qkv_bias"]:
        other_params += L * (lin["q_proj"][1] + 2 * lin["k_proj"][1])
    return linear_params, other_params


def _weight_bytes(s: dict, recipe) -> tuple[float, float, float]:
    """(nf4 weights, 16-bit or fp32 weights, the trained state in bytes: LoRA weights + gradients + AdamW states,
    or, fully fine-tuned, every weight's gradient + AdamW states)."""
    q, lo = recipe.quantization, recipe.lora
    H, L, V = s["hidden"], s["layers"], s["vocab"]
    d = _dtype_bytes(recipe.model.dtype)
    nf4 = planned_nf4(recipe)
    small = 4 if nf4 and q.kbit_upcast else d  # prepare_model_for_kbit_training casts non-quantised weights to fp32
    lin = _linears(s)
    linear_params, other_params = parameter_counts(s)
    weights_nf4 = linear_params * (NF4_BYTES if q.double_quant else NF4_BYTES_NO_DQ) if nf4 else 0
    weights_16 = other_params * small + (0 if nf4 else linear_params * d)
    if recipe.train.finetuning == "full":
        return weights_nf4, weights_16, (linear_params + other_params) * _optimizer_bytes_per_param(recipe)
    targets = _lora_targets(lo.target_modules)
    lora_params = L * sum(lo.r * (a + b) + (b if lo.use_dora else 0) for k, (a, b) in lin.items() if k in targets)
    saved = sum(V * H for m in lo.modules_to_save if m in ("embed_tokens", "lm_head"))  # full trainable copies
    return weights_nf4, weights_16, lora_params * (LORA_BYTES - 8 + _state_bytes(recipe)) + saved * 4 * d


def _layer_bytes(s: dict, recipe, fused: bool, tokens: int) -> tuple[float, float]:
    """(activations kept for backward, the largest layer's recompute + backward working set) in bytes."""
    t, lo = recipe.train, recipe.lora
    H, L, I = s["hidden"], s["layers"], s["intermediate"]
    d = _dtype_bytes(recipe.model.dtype)
    lin = _linears(s)
    layer_tok = (LIGER_LAYER_FIT if fused else LAYER_FIT) * (LAYER_H * H + LAYER_I * I) * d / 2  # fitted at 16 bit
    if lo.dropout > 0 and t.finetuning == "lora":  # peft's dropout keeps an fp32 copy of each LoRA input and its mask
        layer_tok += sum(a for k, (a, _) in lin.items() if k in _lora_targets(lo.target_modules)) * 5
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


def _loss_bytes(s: dict, recipe, fused: bool, tokens: int, n_lab: int) -> float:
    """The loss's working set in bytes: the output layer's logits (chunked or Liger's fused rows) and the digit rows."""
    H, V = s["hidden"], s["vocab"]
    d = _dtype_bytes(recipe.model.dtype)
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
    activations, layer_backward = _layer_bytes(s, recipe, fused, tokens)
    loss = _loss_bytes(s, recipe, fused, tokens, n_lab)
    peak = weights_nf4 + weights_16 + lora_opt + activations + max(loss, layer_backward)
    slack = peak * ALLOCATOR_SLACK
    comp = dict(weights_nf4=weights_nf4, weights_16bit=weights_16, lora_optimizer=lora_opt,
                activations=activations, loss=loss, layer_backward=layer_backward, peak_allocated=peak,
                allocator_slack=slack, cuda_context=CUDA_CONTEXT, total=peak + slack + CUDA_CONTEXT)
    return {k: int(v) for k, v in comp.items()}


def calibration_table() -> list[dict]:
    """plan_memory against every CALIBRATION row (the recipe docs/gpu.md's probe ran), in GiB."""
    from delft.recipe import validate_recipe

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
    from delft.recipe import validate_recipe

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


def read_model_config(recipe) -> tuple[dict, str]:
    """(config.json as a dict, where it came from) without loading or downloading weights."""
    from delft.models.sources import SMOLLM2_ALIAS, cache_dir

    name = recipe.model.name
    if recipe.model.init == "scratch":
        return scratch_config(recipe)
    if name == SMOLLM2_ALIAS:
        path = cache_dir() / SMOLLM2_ALIAS / "config.json"
        if path.is_file():
            return _config(path), str(path)
        return dict(SMOLLM2_CONFIG), "built-in shape of SmolLM2-135M-Instruct"
    if name.endswith(".gguf"):
        from delft.models.sources import gguf_cache_path

        p = Path(name).expanduser()
        if p.is_file():  # the directory delft.models.sources.gguf_to_cache converts it into
            conv = gguf_cache_path(p) / "config.json"
            if conv.is_file():
                return _config(conv), str(conv)
        raise UserError(f"--plan needs a config.json; {name} has not been converted yet", "model.name",
                        "Run `delft train` once on a CPU (it converts the GGUF file) or point model.name at a "
                        "model directory.")
    from delft.models.sources import resolve_model

    ref = resolve_model(name, recipe.model.revision)
    if ref.is_local:
        return _config(Path(ref.path) / "config.json"), str(Path(ref.path) / "config.json")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "config.json", revision=recipe.model.revision)
    except Exception as e:  # noqa: BLE001 - network and hub errors come in many types
        raise UserError(f"could not fetch config.json of {name!r}: {str(e).splitlines()[0][:200]}", "model.name",
                        "Download the model directory where there is network and point model.name at it.") from None
    return _config(Path(path)), f"{name} (config.json from the hub)"


def scratch_config(recipe) -> tuple[dict, str]:
    """The config.json a scratch recipe's init will have (delft.models.scratch.llama_config), without torch."""
    a = recipe.model.architecture
    if recipe.model.tokenizer == "char":
        from delft.models.scratch import CHAR_VOCAB_SIZE

        vocab, where = CHAR_VOCAB_SIZE, "delft's character-level tokenizer"
    else:
        from delft.models.sources import resolve_model

        vocab = _config(Path(resolve_model(recipe.model.tokenizer).path) / "config.json")["vocab_size"]
        where = f"the vocabulary of {recipe.model.tokenizer}"
    return ({"model_type": "llama", "hidden_size": a.hidden_size, "num_hidden_layers": a.layers,
             "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads or a.heads,
             "intermediate_size": a.intermediate_size, "vocab_size": vocab, "tie_word_embeddings": a.tie_embeddings,
             "max_position_embeddings": a.context}, f"model.architecture (init: scratch) with {where}")


def _config(path: Path) -> dict:
    from delft.rundir import read_json

    return read_json(path, "model.name", "Restore or download the model again.")


def with_number_tokens(config: dict, source: str) -> tuple[dict, str]:
    """(config with its tokenizer's number-token count under NUMBER_TOKENS, a note saying where it came from).

    The count comes from the tokenizer.json beside config.json (delft.numbers.tokens, without torch); without one,
    from a NUMBER_TOKENS key the user wrote into the config (planning offline from a config.json alone); else 10
    (single digits), also where the tokenizer is refused (then `delft train` refuses it too)."""
    from delft.numbers.tokens import NumberVocab

    path = Path(source).with_name("tokenizer.json") if Path(source).is_file() else None
    if path is None or not path.is_file():
        if isinstance(config.get(NUMBER_TOKENS), int) and config[NUMBER_TOKENS] > 0:  # written by the user
            return config, f"number tokens: {config[NUMBER_TOKENS]:,}, from {NUMBER_TOKENS} in the config"
        return config, (f"number tokens: no tokenizer.json beside the config, so single digits (10 rows) are assumed "
                        f"(Llama-3: copy its tokenizer.json there, or add \"{NUMBER_TOKENS}\": 1110 to the config)")
    try:
        count = len(NumberVocab.from_tokenizer_file(path).ids)
    except UserError as e:
        return config, f"number tokens: 10 rows assumed; {e.what}"
    return {**config, NUMBER_TOKENS: count}, ""


def _with(recipe, **changes):
    """A copy of the recipe with dotted keys changed (validated)."""
    from delft.recipe import validate_recipe

    data = recipe.to_dict()
    for key, value in changes.items():
        section, field = key.split(".")
        data[section][field] = value
    return validate_recipe(data)


def _halvings(value: int, floor: int):
    v = value
    while v // 2 >= floor:
        v //= 2
        yield v


def suggest_knobs(config: dict, recipe, budget: int, fused: bool, liger_available: bool) -> list[dict]:
    """Changes (one knob each) that bring the total under ``budget``, with what each saves; a combination last."""
    base = plan_memory(config, recipe, fused)["total"]
    out = []

    def trial(key, values, label=None):
        for v in values:
            try:
                r = _with(recipe, **{key: v})
            except UserError:
                return
            total = plan_memory(config, r, fused)["total"]
            if total <= budget:
                out.append(dict(knob=key, to=v, total=total, saves=base - total, note=label))
                return

    t, q = recipe.train, recipe.quantization
    lora = t.finetuning == "lora"
    if q.mode == "none" and lora:
        trial("quantization.mode", ["nf4"])
    if not lora and t.optimizer == "adamw":
        trial("train.optimizer", ["adamw_8bit"], "bitsandbytes' 8-bit AdamW")
    if q.kbit_upcast:
        trial("quantization.kbit_upcast", [False])
    if not t.gradient_checkpointing:
        trial("train.gradient_checkpointing", [True])
    trial("train.batch_size", list(_halvings(t.batch_size, 1)), "raise train.grad_accum to keep the batch")
    trial("data.max_length", list(_halvings(recipe.data.max_length, 64)), "longer examples get truncated")
    trial("train.loss_chunk_size", list(_halvings(t.loss_chunk_size, 64)))
    if lora:
        trial("lora.r", list(_halvings(recipe.lora.r, 4)))
    if recipe.lora.dropout > 0 and lora:
        trial("lora.dropout", [0.0])
    if not fused and liger_available is False:
        total = plan_memory(config, recipe, True)["total"]
        if total <= budget:
            out.append(dict(knob="pip install liger-kernel", to="train.fused_loss: auto", total=total,
                            saves=base - total, note="Liger fused CE + layer kernels on CUDA"))
    if out:
        return out
    # no single knob suffices: turn them together, biggest saving first
    r, steps = recipe, []
    for key, floor in (("quantization.mode", None), ("quantization.kbit_upcast", None),
                       ("train.gradient_checkpointing", None), ("train.batch_size", 1), ("data.max_length", 64),
                       ("train.loss_chunk_size", 64), ("lora.r", 4)):
        section, field = key.split(".")
        if not lora and section in ("quantization", "lora"):
            continue  # full fine-tuning trains unquantised weights, and has no rank
        cur = getattr(getattr(r, section), field)
        target = {"quantization.mode": "nf4", "quantization.kbit_upcast": False,
                  "train.gradient_checkpointing": True}.get(key, floor)
        if cur == target or (key == "quantization.mode" and cur == "auto") or (floor is not None and cur <= floor):
            continue
        r = _with(r, **{key: target})
        steps.append(f"{key}: {target}")
        total = plan_memory(config, r, fused)["total"]
        if total <= budget:
            return [dict(knob=", ".join(steps), to="together", total=total, saves=base - total, note=None)]
    return [dict(knob=", ".join(steps) or "-", to="together", total=plan_memory(config, r, fused)["total"],
                 saves=None, note="still does not fit: use a smaller model or a larger GPU")]


def planned_fused(recipe) -> tuple[bool, bool, str]:
    """(fused path?, liger-kernel installed?, warning) for the recipe's run on a GPU, by training's rule
    (delft.losses.registry.fused_applies). Installed is judged without importing it (no torch here). A run with
    train.fused_loss 'on' but no liger-kernel refuses to start: it is planned as the fused run it insists on."""
    import importlib.util

    from delft.losses.registry import fused_applies

    liger = importlib.util.find_spec("liger_kernel") is not None
    fused, why = fused_applies(recipe.train.fused_loss, cuda=True, liger=liger)
    if why:
        return True, liger, f"train.fused_loss is 'on' but {why}: `delft train` will refuse to start"
    return fused, liger, ""


def _state_words(recipe) -> str:
    t = recipe.train
    if t.optimizer == "sgd":
        return "SGD's momentum buffer" if t.momentum > 0 else "no optimizer state (SGD without momentum)"
    return f"two 8-bit moments ({t.optimizer})" if "8bit" in t.optimizer else "two fp32 moments (AdamW)"


def _component_rows(recipe, s: dict, est: dict, fused: bool, liger: bool) -> list[tuple[str, int, str]]:
    """(component, bytes, what) for the table, in the order they are printed."""
    t = recipe.train
    nf4 = planned_nf4(recipe)
    d = _dtype_bytes(recipe.model.dtype)
    B, T = t.batch_size, recipe.data.max_length
    digits = f"{s['number_tokens']:,}-row digit term"
    loss_name = (f"Liger fused linear CE ({'installed' if liger else 'train.fused_loss: on'})" if fused else
                 f"chunked CE, {min(t.loss_chunk_size, B * T)} rows x vocab {s['vocab']:,} per chunk")
    phase_loss = est["loss"] >= est["layer_backward"]
    return [
        ("weights, 4-bit (nf4)" if nf4 else "weights", est["weights_nf4"] if nf4 else 0,
         (f"{'nf4 + double-quant scales' if recipe.quantization.double_quant else 'nf4 + fp32 scales'} for "
          f"{s['layers']} layers of linear projections") if nf4 else "not quantised (quantization.mode: none)"),
        ("weights, 16-bit" if not recipe.quantization.kbit_upcast else "weights, fp32 (kbit_upcast)",
         est["weights_16bit"], f"embeddings{' (tied output layer)' if s['tied'] else ' + output layer'}, norms"
         + ("" if nf4 else ", linear layers")),
        (("gradients + optimizer", est["lora_optimizer"], f"full fine-tuning: every weight's {d}-byte gradient, "
          + _state_words(recipe)) if t.finetuning == "full" else
         ("LoRA + optimizer", est["lora_optimizer"], f"r={recipe.lora.r}: fp32 weights, gradients, "
          + _state_words(recipe))),
        ("activations", est["activations"],
         (f"each layer input: {B} x {T} x {s['hidden']} x {d} bytes" if t.gradient_checkpointing
          else "every layer keeps its activations (no checkpointing; rough)")),
        ("loss" + ("" if phase_loss else " (not at the peak)"), est["loss"], f"{loss_name}, final hidden, {digits}"),
        ("layer backward" + ("" if not phase_loss else " (not at the peak)"), est["layer_backward"],
         "one layer recomputed and back-propagated" + (" with Liger's layer kernels" if fused else "")
         + (" + dequantised weight" if nf4 else "")),
        ("allocator slack", est["allocator_slack"], f"{ALLOCATOR_SLACK:.0%} fragmentation"),
        ("CUDA context", est["cuda_context"], "driver, kernels, cuBLAS workspace"),
    ]


def _print_table(console, recipe, s: dict, rows: list, est: dict, source: str) -> None:
    from rich.table import Table

    dt = "fp32" if _dtype_bytes(recipe.model.dtype) == 4 else "bf16"
    name = "a model from scratch" if recipe.model.init == "scratch" else recipe.model.name
    table = Table(title=f"Planned peak GPU memory: {name} ({s['model_type']}, {s['layers']} layers, "
                        f"hidden {s['hidden']}, vocab {s['vocab']:,}), {dt}, batch {recipe.train.batch_size} x "
                        f"{recipe.data.max_length} tokens", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("what")
    for name, value, what in rows:
        dim = "(not at the peak)" in name
        table.add_row(f"[dim]{name}[/]" if dim else name, f"[dim]{value / GiB:.2f}[/]" if dim else f"{value / GiB:.2f}",
                      f"[dim]{what}[/]" if dim else what)
    table.add_section()
    table.add_row("[bold]total[/]", f"[bold]{est['total'] / GiB:.2f}[/]",
                  f"torch peak allocated {est['peak_allocated'] / GiB:.2f} GiB + slack + context")
    console.print(table)
    console.print(f"[dim]config: {source}. Upper bound on the data side: rows padded to data.max_length, every "
                  f"position labelled. Calibrated on H200 measurements (docs/performance.md); a GPU plan even when "
                  f"this machine has none.[/]", highlight=False)
    if s["experts"] > 1:
        console.print("[yellow]mixture-of-experts: expert weights counted, activations as if dense (rough).[/]")


def _print_knobs(console, knobs: list[dict]) -> None:
    for k in knobs:
        if k["saves"] is None:
            console.print(f"  even with {k['knob']}: {k['total'] / GiB:.2f} GiB; {k['note']}.", highlight=False)
        elif k["to"] == "together":
            console.print(f"  turn together: {k['knob']} -> {k['total'] / GiB:.2f} GiB", highlight=False)
        else:
            note = f" ({k['note']})" if k["note"] else ""
            console.print(f"  set {k['knob']}: {k['to']} -> {k['total'] / GiB:.2f} GiB, saves "
                          f"{k['saves'] / GiB:.2f} GiB{note}", highlight=False)


def per_gpu(est: dict, world_size: int) -> dict:
    """``plan_memory``'s numbers for each GPU of a ``world_size``-process data-parallel run (delft.training.distributed).

    Each rank runs the one-process step on its own micro-batch of train.batch_size, so its peak is the same; only
    NCCL's buffers come on top. The gradient all-reduce's flat fp32 copy of the LoRA gradients is made after the
    backward, when the activations are gone, so it does not raise the peak.
    """
    if world_size <= 1:
        return est
    return {**est, "nccl_buffers": NCCL_BUFFERS, "total": est["total"] + NCCL_BUFFERS}


def run_plan(recipe, gpu_memory: Optional[str], console, world_size: int = 1) -> dict:
    """Print the estimate as a table, whether it fits ``gpu_memory`` and which knob to turn; returns the numbers.

    With ``world_size`` > 1 every figure is per GPU (``per_gpu``)."""
    config, source = read_model_config(recipe)
    config, note = with_number_tokens(config, source)
    if recipe.model.init == "scratch" and recipe.model.tokenizer == "char":
        note = ""  # single digits, as with_number_tokens assumed
    s = model_shape(config)
    fused, liger, warning = planned_fused(recipe)
    est = per_gpu(plan_memory(config, recipe, fused), world_size)
    rows = _component_rows(recipe, s, est, fused, liger)
    if world_size > 1:
        rows.append(("NCCL buffers", est["nccl_buffers"], f"per GPU of {world_size} processes (rough); the rest "
                     "is one process's step on its micro-batch"))
    _print_table(console, recipe, s, rows, est, source)
    if note:
        console.print(f"[dim]{note}[/]", highlight=False)
    if warning:
        console.print(f"[yellow]{warning}; install liger-kernel or set train.fused_loss: auto.[/]", highlight=False)
    result = dict(components=est, config_source=source, fused=fused)
    if gpu_memory is None:
        console.print("Pass --gpu-memory 8GiB to check a budget.")
        return result
    budget = parse_memory(gpu_memory)
    result.update(budget=budget, fits=est["total"] <= budget)
    if est["total"] <= budget:
        console.print(f"[bold green]fits[/] in {budget / GiB:.2f} GiB ({(budget - est['total']) / GiB:.2f} GiB "
                      "to spare)", highlight=False)
        return result
    console.print(f"[bold red]does not fit[/] in {budget / GiB:.2f} GiB: {est['total'] / GiB:.2f} GiB planned, "
                  f"{(est['total'] - budget) / GiB:.2f} GiB over.", highlight=False)
    result["knobs"] = suggest_knobs(config, recipe, budget - est.get("nccl_buffers", 0), fused, liger)
    for k in result["knobs"]:
        k["total"] += est.get("nccl_buffers", 0)
    _print_knobs(console, result["knobs"])
    raise PlanDoesNotFit(result, gpu_memory)


class PlanDoesNotFit(UserError):
    """``run_plan``'s refusal (exit 2) once the table and the knobs are printed: the run does not fit
    --gpu-memory. ``plan`` is what run_plan would have returned (components, budget, knobs)."""

    def __init__(self, plan: dict, gpu_memory: str):
        self.plan = plan
        total, budget = plan["components"]["total"], plan["budget"]
        knob = next((k for k in plan["knobs"] if k["saves"] is not None and k["to"] != "together"
                     and "." in k["knob"] and " " not in k["knob"]), None)
        if knob is not None:
            value = str(knob["to"]).lower() if isinstance(knob["to"], bool) else knob["to"]
            fix = (f"Turn one of the settings listed above (e.g. --set {knob['knob']}={value}) and plan again, or "
                   "plan for a GPU with more memory.")
        elif any(k["saves"] is not None for k in plan["knobs"]):
            fix = "Turn the settings listed above and plan again, or plan for a GPU with more memory."
        else:
            fix = "Use a smaller model or a GPU with more memory."
        super().__init__(f"the run does not fit: {total / GiB:.2f} GiB planned per GPU, {(total - budget) / GiB:.2f} "
                         f"GiB more than --gpu-memory {gpu_memory} ({budget / GiB:.2f} GiB)", "recipe check --plan",
                         fix)
