"""When a plan does not fit: the settings to turn (batch size, length, checkpointing, 4-bit, LoRA rank, fused
loss), each with the memory it saves, found by re-planning the recipe with that one change."""

from __future__ import annotations

from delft.errors import UserError
from delft.planning.memory import plan_memory
from delft.recipe.schema import validate_recipe


def _with(recipe, **changes):
    """A copy of the recipe with dotted keys changed (validated)."""
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
