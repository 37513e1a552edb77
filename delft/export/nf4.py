"""The nf4 round trip: a QLoRA adapter was trained against nf4-dequantised base weights, so
`export --match-training` rounds the base weights through nf4 before merging (and counts the layers it did).
"""

from __future__ import annotations


def dequantize_nf4(packed, state):
    """Inverse of ``bitsandbytes.functional.quantize_4bit`` (nf4, optionally double-quantised statistics).

    Pure torch on purpose: bitsandbytes 0.50's native CPU ``dequantize_4bit`` returns wrong values when a
    weight's last dimension is not a multiple of the blocksize (blocks that cross rows); the arithmetic
    here is the CUDA kernel's (code[index] * absmax), in fp32.
    """
    import torch

    absmax = state.absmax
    if state.nested:
        s2 = state.state2
        n = absmax.numel()
        absmax = (s2.code.to(absmax.device)[absmax.long()]
                  * s2.absmax.float().repeat_interleave(s2.blocksize)[:n] + state.offset)
    b = packed.reshape(-1).view(torch.uint8)
    idx = torch.stack([b >> 4, b & 15], dim=1).reshape(-1).long()
    numel = 1
    for d in state.shape:
        numel *= d
    code = state.code.to(device=b.device, dtype=torch.float32)
    values = code[idx[:numel]] * absmax.float().repeat_interleave(state.blocksize)[:numel]
    return values.reshape(state.shape)


def nf4_roundtrip(weight, double_quant: bool, blocksize: int = 64):
    """W -> dequant(quant_nf4(W)) in fp32, as bitsandbytes' Linear4bit stored it during training."""
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(weight.detach().contiguous(), blocksize=blocksize,
                                       compress_statistics=double_quant, quant_type="nf4")
    return dequantize_nf4(packed, state).to(weight.dtype)


def quantized_linear_names(model) -> list[str]:
    """The linear layers transformers hands to bitsandbytes for nf4: every nn.Linear except the output layer
    (and weights tied to it) and the model's fp32-kept modules - not only the LoRA-targeted ones, since the
    adapter was trained on top of all of them."""
    from torch import nn

    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        skip = set(get_keys_to_not_convert(model))
    except Exception:  # older/newer transformers: at least keep the output layer
        out_emb = model.get_output_embeddings()
        skip = {n for n, m in model.named_modules() if m is out_emb}
    skip |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    try:
        from transformers.quantizers.quantizers_utils import should_convert_module

        def skipped(name: str) -> bool:
            return not should_convert_module(name, list(skip))
    except ImportError:
        def skipped(name: str) -> bool:
            return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)

    return [n for n, m in model.named_modules() if type(m) is nn.Linear and not skipped(n)]


def apply_nf4_roundtrip(model, double_quant: bool) -> int:
    import torch

    names = quantized_linear_names(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in names:
            w = modules[name].weight
            w.data.copy_(nf4_roundtrip(w.data, double_quant))
    return len(names)
