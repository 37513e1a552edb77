"""``delft recipe check RECIPE --plan``: the memory plan as a table, whether it fits ``--gpu-memory``, and the
knobs to turn when it does not (a refusal, exit 2)."""

from __future__ import annotations

from typing import Optional

from delft.errors import UserError
from delft.planning.fsdp import GATHERED_LAYERS, MAX_WORLD_SIZE, plan_fsdp
from delft.planning.knobs import suggest_knobs, world_size_fit
from delft.planning.memory import (
    ALLOCATOR_SLACK,
    GiB,
    dtype_bytes,
    parse_memory,
    per_gpu,
    plan_memory,
    planned_fused,
    planned_nf4,
)
from delft.planning.shapes import NUMBER_TOKENS, model_shape, read_model_config, shipped_shape, with_number_tokens
from delft.recipe.train_section import EIGHT_BIT_OPTIMIZERS


def _state_words(recipe) -> str:
    t = recipe.train
    if t.optimizer == "sgd":
        return "SGD's momentum buffer" if t.momentum > 0 else "no optimizer state (SGD without momentum)"
    return f"two 8-bit moments ({t.optimizer})" if t.optimizer in EIGHT_BIT_OPTIMIZERS else "two fp32 moments (AdamW)"


def _component_rows(recipe, s: dict, est: dict, fused: bool, liger: bool) -> list[tuple[str, int, str]]:
    """(component, bytes, what) for the table, in the order they are printed."""
    t = recipe.train
    nf4 = planned_nf4(recipe)
    d = dtype_bytes(recipe.model.dtype)
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
        *_step_rows(recipe, s, est, fused, liger),
        *_overhead_rows(est),
    ]


def _step_rows(recipe, s: dict, est: dict, fused: bool, liger: bool, at_peak: bool = True) -> list:
    """The activations, loss and layer-backward rows. The smaller of the two phases is marked as not at the peak,
    and all three are when ``at_peak`` is False (under fsdp, when the root's gradient reduce is the larger phase)."""
    t = recipe.train
    d = dtype_bytes(recipe.model.dtype)
    B, T = t.batch_size, recipe.data.max_length
    digits = f"{s['number_tokens']:,}-row digit term"
    loss_name = (f"Liger fused linear CE ({'installed' if liger else 'train.fused_loss: on'})" if fused else
                 f"chunked CE, {min(t.loss_chunk_size, B * T)} rows x vocab {s['vocab']:,} per chunk")
    phase_loss = est["loss"] >= est["layer_backward"] + est.get("layer_grads", 0)
    off = " (not at the peak)"
    return [
        ("activations" + ("" if at_peak else off), est["activations"],
         (f"each layer input: {B} x {T} x {s['hidden']} x {d} bytes" if t.gradient_checkpointing
          else "every layer keeps its activations (no checkpointing; rough)")),
        ("loss" + ("" if phase_loss and at_peak else off), est["loss"], f"{loss_name}, final hidden, {digits}"),
        ("layer backward" + ("" if not phase_loss and at_peak else off), est["layer_backward"],
         "one layer recomputed and back-propagated" + (" with Liger's layer kernels" if fused else "")
         + (" + dequantised weight" if planned_nf4(recipe) else "")),
    ]


def _overhead_rows(est: dict) -> list:
    return [("allocator slack", est["allocator_slack"], f"{ALLOCATOR_SLACK:.0%} fragmentation"),
            ("CUDA context", est["cuda_context"], "driver, kernels, cuBLAS workspace")]


def _fsdp_rows(recipe, s: dict, est: dict, fused: bool, liger: bool) -> list[tuple[str, int, str]]:
    """The table's rows under train.distributed fsdp (``plan_fsdp``'s components), per rank."""
    t, n = recipe.train, est["world_size"]
    dt = "bf16"  # FSDP's compute dtype on CUDA (MixedPrecisionPolicy), whatever model.dtype says
    full = t.finetuning == "full"
    where = "in CPU memory (train.cpu_offload), not on the GPU: " if t.cpu_offload else ""
    on_gpu = 0 if t.cpu_offload else 1
    root = f"embeddings{' (tied output layer)' if s['tied'] else ' + output layer'}, final norm"
    backward = (est["gathered_root"] + est["gathered_layers"] + est["activations"] + est["output_grad"]
                + max(est["loss"], est["layer_backward"] + est["layer_grads"]))
    reduce_peak = est["root_reduce"] > backward
    layer_peak = not reduce_peak and est["loss"] < est["layer_backward"] + est["layer_grads"]
    off = " (not at the peak)"
    return [
        ("weights, sharded", est["sharded_weights"] * on_gpu, where + (
            f"fp32 master weights / {n} ranks" if full else f"frozen base in fp32 / {n} ranks")
         + (f" ({est['sharded_weights'] / GiB:.2f} GiB)" if t.cpu_offload else "")),
        ("gradients + optimizer, sharded" if full else "LoRA + optimizer, sharded", est["sharded_trained"] * on_gpu,
         where + ("fp32 gradients, " if full else f"r={recipe.lora.r}: fp32 weights, gradients, ")
         + f"{_state_words(recipe)} / {n} ranks"
         + (f" ({est['sharded_trained'] / GiB:.2f} GiB)" if t.cpu_offload else "")),
        ("gathered root" + (off if reduce_peak else ""), est["gathered_root"],
         f"{root} in {dt}, all-gathered for the whole step"),
        ("gathered layers" + (off if reduce_peak else ""), est["gathered_layers"],
         f"{min(GATHERED_LAYERS, s['layers'])} decoder layers in {dt}: the one computing and the one prefetched"),
        *_step_rows(recipe, s, est, fused, liger, at_peak=not reduce_peak),
        *([("output-layer gradient" + (off if reduce_peak else ""), est["output_grad"],
            f"unsharded, in {dt}: from the loss's backward to the root's reduce-scatter")]
          if est["output_grad"] else []),
        ("layer gradients" + ("" if layer_peak else off), est["layer_grads"],
         f"a layer's unsharded {dt} gradients + the fp32 reduce-scatter input FSDP2 keeps"),
        ("root gradient reduce" + ("" if reduce_peak else off), est["root_reduce"],
         "end of backward, activations and gathers freed: the root's gradients + their fp32 reduce-scatter input"),
        *_overhead_rows(est),
        *([("NCCL buffers", est["nccl_buffers"], f"per GPU of {n} processes (rough)")] if n > 1 else []),
    ]


def _print_table(console, recipe, s: dict, rows: list, est: dict, source: str) -> None:
    from rich.table import Table

    dt = "fp32" if dtype_bytes(recipe.model.dtype) == 4 else "bf16"
    name = "a model from scratch" if recipe.model.init == "scratch" else recipe.model.name
    fsdp = recipe.train.distributed == "fsdp"
    scope = f" per rank of {est['world_size']} (fsdp)" if fsdp else ""
    table = Table(title=f"Planned peak GPU memory{scope}: {name} ({s['model_type']}, {s['layers']} layers, "
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
    if fsdp:
        console.print("[dim]fsdp: the sharding, the gathered layers and the gradient buffers are counted from FSDP2's "
                      "design (fully_shard per decoder layer, then the root; bf16 gathers, fp32 reduce-scatter), "
                      "not yet measured on a GPU.[/]", highlight=False)
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


def _plan_rows(config: dict, recipe, s: dict, fused: bool, liger: bool, world_size: int) -> tuple[dict, list]:
    """(the per-GPU plan, the table's rows) by the recipe's train.distributed."""
    if recipe.train.distributed == "fsdp":
        est = plan_fsdp(config, recipe, world_size, fused)
        return est, _fsdp_rows(recipe, s, est, fused, liger)
    est = per_gpu(plan_memory(config, recipe, fused), world_size)
    rows = _component_rows(recipe, s, est, fused, liger)
    if world_size > 1:
        rows.append(("NCCL buffers", est["nccl_buffers"], f"per GPU of {world_size} processes (rough); the rest "
                     "is one process's step on its micro-batch"))
    return est, rows


def _print_fit(console, fit: dict, budget: int) -> None:
    """world_size_fit's answer in one or two lines."""
    gib = f"{budget / GiB:.2f} GiB"
    if fit["world_size"] is not None:
        two = fit["power_of_two"]
        console.print(f"fsdp: first fits {gib} per rank at world size {fit['world_size']} ({fit['tried']} tried; "
                      f"the first power of two that fits: {two if two is not None else 'none'})",
                      highlight=False)
        return
    console.print(f"fsdp: never fits {gib} per rank within {MAX_WORLD_SIZE} ranks ({fit['total_at_max'] / GiB:.2f} "
                  f"GiB per rank at {MAX_WORLD_SIZE}: only the shards shrink with more ranks)", highlight=False)
    for h in fit["helps"]:
        at = f"fits at world size {h['world_size']}" if h["world_size"] is not None else "still does not fit"
        console.print(f"  with {h['change']}: {at}", highlight=False)


def _model_config(recipe, shape: Optional[str]) -> tuple:
    """(recipe, config, where it came from, a note on its number tokens): model.name's config.json, or with
    ``shape`` a shipped shape, the recipe then naming the model it is the shape of."""
    if shape is None:
        config, source = read_model_config(recipe)
        config, note = with_number_tokens(config, source)
        if recipe.model.init == "scratch" and recipe.model.tokenizer == "char":
            note = ""  # single digits, as with_number_tokens assumed
        return recipe, config, source, note
    if recipe.model.init == "scratch":
        raise UserError("--shape plans a pretrained model's shape, and this recipe builds its model from scratch "
                        "(model.init: scratch, its shape in model.architecture)", "--shape",
                        "Drop --shape: the plan reads model.architecture.")
    config, source, hub_id = shipped_shape(shape)
    recipe = recipe.model_copy(deep=True)
    recipe.model.name = hub_id
    count = config[NUMBER_TOKENS]
    kind = "each digit alone" if count == 10 else "1-3 digit numbers as single tokens"
    return recipe, config, source, f"number tokens: {count:,} ({kind}), from the shipped shape"


def run_plan(recipe, gpu_memory: Optional[str], console, world_size: int = 1, shape: Optional[str] = None) -> dict:
    """Print the estimate as a table, whether it fits ``gpu_memory`` and which knob to turn; returns the numbers.

    With ``world_size`` > 1 every figure is per GPU: one process's plan plus NCCL's buffers (``per_gpu``), or under
    train.distributed fsdp each rank's share (``plan_fsdp``). Under fsdp with a budget, the result's
    "world_size_fit" (``world_size_fit``) also says at which world size the run first fits it. With ``shape``, a
    shipped shape (qwen2.5-7b, ...) is planned in place of model.name's config.json."""
    recipe, config, source, note = _model_config(recipe, shape)
    s = model_shape(config)
    fused, liger, warning = planned_fused(recipe)
    fsdp = recipe.train.distributed == "fsdp"
    est, rows = _plan_rows(config, recipe, s, fused, liger, world_size)
    _print_table(console, recipe, s, rows, est, source)
    if note:
        console.print(f"[dim]{note}[/]", highlight=False)
    if warning:
        console.print(f"[yellow]{warning}; install liger-kernel or set train.fused_loss: auto.[/]", highlight=False)
    result = dict(components=est, config_source=source, fused=fused, distributed=recipe.train.distributed)
    if gpu_memory is None:
        console.print("Pass --gpu-memory 8GiB to check a budget.")
        return result
    budget = parse_memory(gpu_memory)
    result.update(budget=budget, fits=est["total"] <= budget)
    if fsdp:
        result["world_size_fit"] = world_size_fit(config, recipe, fused, budget)
        _print_fit(console, result["world_size_fit"], budget)
    if est["total"] <= budget:
        console.print(f"[bold green]fits[/] in {budget / GiB:.2f} GiB ({(budget - est['total']) / GiB:.2f} GiB "
                      "to spare)", highlight=False)
        return result
    console.print(f"[bold red]does not fit[/] in {budget / GiB:.2f} GiB: {est['total'] / GiB:.2f} GiB planned, "
                  f"{(est['total'] - budget) / GiB:.2f} GiB over.", highlight=False)
    nccl = 0 if fsdp else est.get("nccl_buffers", 0)  # plan_fsdp's totals already hold them
    result["knobs"] = suggest_knobs(config, recipe, budget - nccl, fused, liger, world_size)
    for k in result["knobs"]:
        k["total"] += nccl
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
        n = (plan.get("world_size_fit") or {}).get("world_size")
        if n is not None and n > plan["components"].get("world_size", 1):
            fix = f"Shard over more ranks (fsdp first fits at --world-size {n}), or: {fix[0].lower()}{fix[1:]}"
        super().__init__(f"the run does not fit: {total / GiB:.2f} GiB planned per GPU, {(total - budget) / GiB:.2f} "
                         f"GiB more than --gpu-memory {gpu_memory} ({budget / GiB:.2f} GiB)", "recipe check --plan",
                         fix)
