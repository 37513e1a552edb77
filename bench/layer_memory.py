"""What Liger's layer kernels save: allocation peak of a checkpointed LoRA layer, eager vs Liger, on the CPU.

    python bench/layer_memory.py            # ~1 min on 2 cores; writes bench/results/layer_memory_cpu.json

Builds 2-layer random-init Qwen2 models with the layer shapes of docs/gpu.md's 0.5B, 1.5B and 7B (bf16, LoRA r=16 on
every projection, non-reentrant gradient checkpointing, as delft trains), runs one forward and backward of T
tokens, and counts every tensor storage the step allocates through torch's dispatcher (a TorchDispatchMode that
adds a storage's bytes when an op creates it and subtracts them when it is freed; weights and buffers are not
counted). "Liger" applies delft.models.loading.apply_liger_layers (RMSNorm, SwiGLU, RoPE), whose Triton kernels run
under Triton's interpreter (TRITON_INTERPRET=1): they allocate their outputs through torch exactly as on a GPU,
and their internal work, which lives in registers and shared memory on a GPU, is not a torch allocation here
either. What this cannot see: the CUDA caching allocator's rounding, cuBLAS workspaces and kernels that
allocate differently on a GPU (SDPA picks another backend there; bitsandbytes nf4 is not used here).

Reported per token: backward_increment = peak - live after forward (the plan's "layer backward" phase plus the
LoRA gradients as they appear), and the ratio Liger / eager.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from functools import partial
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before liger_kernel is imported
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # hidden, intermediate, heads, kv heads (the Qwen2 configs of docs/gpu.md's probe)
    "0.5b": (896, 4864, 14, 2),
    "1.5b": (1536, 8960, 12, 2),
    "7b": (3584, 18944, 28, 4),
}


def allocation_tracker():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class EarlyStopping(TorchDispatchMode):
        def __init__(self, skip):
            super().__init__()
            self.live = self.peak = 0
            self.refs, self.skip = {}, skip

        def _free(self, key, nbytes, _ref):
            self.live -= nbytes
            self.refs.pop(key, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                key, nbytes = st.data_ptr(), st.nbytes()
                if nbytes == 0 or key in self.refs or key in self.skip:  # views share their base's storage
                    continue
                self.live += nbytes
                self.refs[key] = weakref.ref(st, partial(self._free, key, nbytes))
                self.peak = max(self.peak, self.live)
            return out

    return EarlyStopping


def build(shape: str, liger: bool):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from delft.models.loading import apply_liger_layers, apply_lora
    from delft.recipe.schema import LoraConfig

    H, I, heads, kv = SHAPES[shape]
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    kernels = apply_liger_layers(model) if liger else []
    model = apply_lora(model, LoraConfig(r=16, alpha=32, dropout=0.0), gradient_checkpointing=True)
    model.train()
    return model, kernels


def measure(shape: str, liger: bool, tokens: int) -> dict:

    from transformers.models.qwen2 import modeling_qwen2

    rope = modeling_qwen2.apply_rotary_pos_emb  # Liger's RoPE patch is module-wide: undo it after measuring
    try:
        return _measure(shape, liger, tokens)
    finally:
        modeling_qwen2.apply_rotary_pos_emb = rope


def _measure(shape: str, liger: bool, tokens: int) -> dict:
    import torch

    model, kernels = build(shape, liger)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(0))
    tracker = allocation_tracker()(skip)
    t0 = time.perf_counter()
    with tracker:
        hidden = model.get_base_model().model(input_ids=ids).last_hidden_state
        loss = hidden.float().pow(2).mean()  # a loss that allocates next to nothing: the layers are measured
        after_forward = tracker.live
        loss.backward()
    return dict(kernels=kernels, tokens=tokens, after_forward_per_token=after_forward / tokens,
                peak_per_token=tracker.peak / tokens,
                backward_increment_per_token=(tracker.peak - after_forward) / tokens,
                seconds=round(time.perf_counter() - t0, 1))


def main():
    from delft.losses.triton_cpu import patch_interpreter

    quiet()
    patch_interpreter()
    tokens = int(os.environ.get("TOKENS", 256))
    rows = []
    for shape in SHAPES:
        eager, liger = measure(shape, False, tokens), measure(shape, True, tokens)
        ratio = liger["backward_increment_per_token"] / eager["backward_increment_per_token"]
        rows.append(dict(shape=shape, eager=eager, liger=liger, liger_over_eager=round(ratio, 4)))
        print(f"{shape:<5} backward increment per token: eager {eager['backward_increment_per_token']:>9,.0f} B, "
              f"Liger layer kernels {liger['backward_increment_per_token']:>9,.0f} B  ({ratio:.3f}x)")
    out = ROOT / "bench" / "results" / "layer_memory_cpu.json"
    out.write_text(json.dumps(dict(what=__doc__.split("\n\n")[2].replace("\n", " "), rows=rows), indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


def quiet():
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("liger_kernel").setLevel(logging.ERROR)


if __name__ == "__main__":
    main()
