"""``delft recipe check RECIPE --plan``: the memory plan as a table, whether it fits ``--gpu-memory``, and the
knobs to turn when it does not (a refusal, exit 2)."""

from __future__ import annotations

from typing import Optional

from delft.errors import UserError
from delft.planning.knobs import suggest_knobs
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
from delft.planning.shapes import model_shape, read_model_config, with_number_tokens


def _state_words(recipe) -> str:
    t = recipe.train
    if t.optimizer == "sgd":
        return "SGD's momentum buffer" if t.momentum > 0 else "no optimizer state (SGD without momentum)"
    return f"two 8-bit moments ({t.optimizer})" if "8bit" in t.optimizer else "two fp32 moments (AdamW)"


def _component_rows(recipe, s: dict, est: dict, fused: bool, liger: bool) -> list[tuple[str, int, str]]:
    """(component, bytes, what) for the table, in the order they are printed."""
    t = recipe.train
    nf4 = planned_nf4(recipe)
    d = dtype_bytes(recipe.model.dtype)
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

    dt = "fp32" if dtype_bytes(recipe.model.dtype) == 4 else "bf16"
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
