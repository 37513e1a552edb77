"""When a plan does not fit: the settings to turn (batch size, length, checkpointing, 4-bit, LoRA rank, fused
loss), each with the memory it saves, found by re-planning the recipe with that one change."""

from __future__ import annotations

from delft.errors import UserError
from delft.planning.fsdp import MAX_WORLD_SIZE, plan_fsdp
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


def suggest_knobs(config: dict, recipe, budget: int, fused: bool, liger_available: bool,
                  world_size: int = 1) -> list[dict]:
    """Changes (one knob each) that bring the total under ``budget``, with what each saves; a combination last.

    Under train.distributed fsdp the totals are per rank of ``world_size`` (``plan_fsdp``, NCCL's buffers included).
    Neither nf4 nor the 8-bit AdamWs is offered there, because fsdp refuses both; train.cpu_offload is. Otherwise
    the totals are one process's ``plan_memory``. train.grad_accum is never offered: neither plan depends on it."""
    fsdp = recipe.train.distributed == "fsdp"

    def planned(r, f=fused):
        return plan_fsdp(config, r, world_size, f)["total"] if fsdp else plan_memory(config, r, f)["total"]

    base = planned(recipe)
    out = []

    def trial(key, values, label=None):
        for v in values:
            try:
                r = _with(recipe, **{key: v})
            except UserError:
                return
            total = planned(r)
            if total <= budget:
                out.append(dict(knob=key, to=v, total=total, saves=base - total, note=label))
                return

    t, q = recipe.train, recipe.quantization
    lora = t.finetuning == "lora"
    if fsdp and not t.cpu_offload:
        trial("train.cpu_offload", [True], "FSDP2 keeps the shards in CPU memory; slower steps")
    if q.mode == "none" and lora and not fsdp:
        trial("quantization.mode", ["nf4"])
    if not lora and t.optimizer == "adamw" and not fsdp:
        trial("train.optimizer", ["adamw_8bit"], "bitsandbytes' 8-bit AdamW")
    if q.kbit_upcast and not fsdp:
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
        total = planned(recipe, True)
        if total <= budget:
            out.append(dict(knob="pip install liger-kernel", to="train.fused_loss: auto", total=total,
                            saves=base - total, note="Liger fused CE + layer kernels on CUDA"))
    return out or _together(recipe, budget, base, planned)


def _together(recipe, budget: int, base: int, planned) -> list[dict]:
    """No single knob suffices: turn them together, biggest saving first, until the run fits (or none is left)."""
    r, steps = recipe, []
    lora, fsdp = recipe.train.finetuning == "lora", recipe.train.distributed == "fsdp"
    for key, floor in (("train.cpu_offload", None), ("quantization.mode", None), ("quantization.kbit_upcast", None),
                       ("train.gradient_checkpointing", None), ("train.batch_size", 1), ("data.max_length", 64),
                       ("train.loss_chunk_size", 64), ("lora.r", 4)):
        section, field = key.split(".")
        if not lora and section in ("quantization", "lora"):
            continue  # full fine-tuning trains unquantised weights, and has no rank
        if (key == "train.cpu_offload" and not fsdp) or (fsdp and section == "quantization"):
            continue  # cpu_offload is fsdp's alone; fsdp refuses nf4
        cur = getattr(getattr(r, section), field)
        target = {"quantization.mode": "nf4", "quantization.kbit_upcast": False, "train.cpu_offload": True,
                  "train.gradient_checkpointing": True}.get(key, floor)
        if cur == target or (key == "quantization.mode" and cur == "auto") or (floor is not None and cur <= floor):
            continue
        r = _with(r, **{key: target})
        steps.append(f"{key}: {target}")
        total = planned(r)
        if total <= budget:
            return [dict(knob=", ".join(steps), to="together", total=total, saves=base - total, note=None)]
    return [dict(knob=", ".join(steps) or "-", to="together", total=planned(r),
                 saves=None, note="still does not fit: use a smaller model or a larger GPU")]


def _first_fit(config: dict, recipe, fused: bool, budget: int, sizes) -> int | None:
    return next((n for n in sizes if plan_fsdp(config, recipe, n, fused)["total"] <= budget), None)


def world_size_fit(config: dict, recipe, fused: bool, budget: int) -> dict:
    """At which world size an fsdp run first fits ``budget`` per rank.

    Every world size from 1 to MAX_WORLD_SIZE is tried (FSDP2 shards over any count), and the powers of two on
    their own, because machines hold 1, 2, 4 or 8 GPUs. Only the shards shrink with more ranks; the gathered root
    and layers, the activations and the loss do not. So the per-rank total at MAX_WORLD_SIZE is reported too, near
    the floor no world size gets under. When no world size fits, the changes that could help (train.cpu_offload,
    LoRA instead of full fine-tuning, gradient checkpointing, and all of them together) are each planned again.
    Keys: tried, world_size, power_of_two (None: never within MAX_WORLD_SIZE), total_at_max, helps (change, settings,
    world_size).
    """
    sizes = range(1, MAX_WORLD_SIZE + 1)
    powers = [2**k for k in range(MAX_WORLD_SIZE.bit_length()) if 2**k <= MAX_WORLD_SIZE]
    out = dict(tried=f"every world size 1..{MAX_WORLD_SIZE}",
               world_size=_first_fit(config, recipe, fused, budget, sizes),
               power_of_two=_first_fit(config, recipe, fused, budget, powers),
               total_at_max=plan_fsdp(config, recipe, MAX_WORLD_SIZE, fused)["total"], helps=[])
    if out["world_size"] is not None:
        return out
    t = recipe.train
    changes = {"train.cpu_offload": True} if not t.cpu_offload else {}
    if t.finetuning == "full":
        changes["train.finetuning"] = "lora"
    if not t.gradient_checkpointing:
        changes["train.gradient_checkpointing"] = True
    trials = [{k: v} for k, v in changes.items()] + ([changes] if len(changes) > 1 else [])
    for change in trials:
        try:
            r = _with(recipe, **change)
        except UserError:
            continue  # e.g. a from-scratch model has no pretrained weights for LoRA to adapt
        words = " + ".join(f"{k}: {str(v).lower()}" for k, v in change.items())
        out["helps"].append(dict(change=words, settings=change, world_size=_first_fit(config, r, fused, budget, sizes)))
    return out
