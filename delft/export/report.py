"""What an export says about itself: the result record, the model card (README.md in the export), the
export info JSON, the failure marker text and the summary table.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from rich.table import Table

from delft import __version__
from delft.data.sources import HUB_ID
from delft.errors import UserError
from delft.evaluation.metrics import HEADLINE
from delft.losses.registry import LOSS_TYPES
from delft.outputs import human_size
from delft.recipe.files import load_run_recipe
from delft.rundir import EXPORT_INFO, RECIPE  # noqa: F401 (EXPORT_INFO: merge and gguf import it from here)


def load_recipe_quietly(run_dir: Path):
    """The run's recipe as it trained (delft.recipe.files.load_run_recipe), or None when it has no readable one."""
    if not (run_dir / RECIPE).is_file():
        return None
    try:
        return load_run_recipe(run_dir)
    except UserError:
        return None


def recipe_summary(recipe) -> list[tuple[str, str]]:
    if recipe is None:
        return []
    d, t, lo = recipe.data, recipe.train, recipe.lora
    targets = lo.target_modules if isinstance(lo.target_modules, str) else ", ".join(lo.target_modules)
    steps = f"max_steps {t.max_steps}" if t.max_steps else f"{t.epochs:g} epochs"
    source = f"{d.source} ({d.format}" + (f", n={d.synthetic.n}" if d.source == "synthetic" else "") + ")"
    return [
        ("data", f"{source}, max_length {d.max_length}, template {d.template}"),
        ("LoRA", f"r {lo.r}, alpha {lo.alpha:g}, dropout {lo.dropout:g}, targets {targets}"),
        ("quantization", f"{recipe.quantization.mode} (double quant {'on' if recipe.quantization.double_quant else 'off'})"),
        ("optimisation", f"{steps}, batch {t.batch_size} x {t.grad_accum} accumulation, lr {t.learning_rate:g} "
                         f"{t.lr_scheduler}, warmup {t.warmup_ratio:g}, seed {t.seed}"),
        ("model dtype in training", f"{recipe.model.dtype} on {recipe.model.device}"),
    ]


def eval_headline(run_dir: Path) -> list[tuple[str, str]]:
    """Headline numbers of the run's eval.json (delft eval --json), if any; tolerant of other layouts."""
    path = run_dir / "eval.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return [("eval.json", "present but not readable")]
    rates = {m.key: m.rate for m in HEADLINE}  # the count of problems first, then the headline metrics

    def fmt(metrics: dict) -> str:
        parts = []
        for k in ("n", *rates):
            v = metrics.get(k)
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, (int, float)):
                parts.append(f"{k} {v:.1%}" if rates.get(k) else f"{k} {v:g}")
        return ", ".join(parts)

    rows = []
    if isinstance(data, dict) and isinstance(data.get("models"), list):
        for m in data["models"]:
            if isinstance(m, dict) and isinstance(m.get("metrics"), dict) and fmt(m["metrics"]):
                rows.append((str(m.get("name", "model")), fmt(m["metrics"])))
    elif isinstance(data, dict):
        metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else data
        if fmt(metrics):
            rows.append(("eval", fmt(metrics)))
    return rows or [("eval.json", "no headline metrics found")]


def _is_hub_id(name: str) -> bool:
    return bool(re.fullmatch(HUB_ID, name)) and not Path(name).expanduser().exists()


def loss_description(loss: str, weight) -> str:
    """The model card's loss row, read from the loss table: CE plus lambda times the term for a loss that adds one;
    the table's own line for one that adds none (CE alone, or dft, which weights CE itself and takes no lambda)."""
    kind = LOSS_TYPES.get(loss)
    if kind is not None and not kind.has_term:
        return f"{loss}: {kind.summary}"
    return f"CE + lambda x {loss} with lambda = {weight:g}" if isinstance(weight, (int, float)) else str(loss)


def model_card(r: ExportResult, info: dict, recipe, evals: list, run_dir: Path) -> str:
    loss = info.get("loss") or (recipe.loss.type if recipe else "?")
    loss_text = loss_description(loss, info.get("loss_weight", recipe.loss.weight if recipe else None))
    front = ["---", "library_name: transformers", "tags:", "- delft", "- lora", "- merged"]
    if info.get("quantization") == "nf4":
        front.append("- qlora")
    if _is_hub_id(r.base_model):
        front.append(f"base_model: {r.base_model}")
    front.append("---")
    check = (f"max |dlogit| {r.max_abs_diff:.3g} (tolerance {r.tolerance:.3g}), fp32 merge {r.merge_abs_diff:.3g}, "
             f"{r.tensors_checked} tensors bit-identical to the merge" if r.max_abs_diff is not None else "not run")
    lines = front + [
        "",
        f"# {Path(r.out).name}",
        "",
        "A LoRA adapter trained with [delft](https://pypi.org/project/delft/) and merged into its base model. "
        "Loads with plain transformers; delft is not needed.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{r.base_model}` |",
        f"| adapter (run directory) | `{run_dir}` |",
        f"| merge | {r.merge_detail} |",
        f"| dtype | {r.dtype} |",
        f"| loss | {loss_text} |",
        f"| training steps | {info.get('step', '?')} of {info.get('total_steps', '?')} "
        f"(status {info.get('status', '?')}) |",
        f"| quantization in training | {info.get('quantization', '?')} |",
        f"| merge check | {'passed' if r.passed else '**FAILED**'}: {check} |",
        "",
    ]
    summary = recipe_summary(recipe)
    if summary:
        lines += ["## Recipe", ""] + [f"- **{k}**: {v}" for k, v in summary] + [""]
    if evals:
        lines += ["## Evaluation (from the run's eval.json)", ""] + [f"- **{k}**: {v}" for k, v in evals] + [""]
    if r.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in r.notes] + [""]
    lines += [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tok = AutoTokenizer.from_pretrained("{Path(r.out).name}")',
        f'model = AutoModelForCausalLM.from_pretrained("{Path(r.out).name}", dtype="auto")',
        "```",
        "",
    ]
    return "\n".join(lines)


def why_failed(r: ExportResult) -> str:
    parts = []
    if r.max_abs_diff is not None and r.max_abs_diff > r.tolerance:
        parts.append(f"max |dlogit| {r.max_abs_diff:.3g} > tolerance {r.tolerance:.3g}")
    if r.merge_abs_diff is not None and r.merge_abs_diff > r.merge_tolerance:
        parts.append(f"the fp32 merge differs by {r.merge_abs_diff:.3g} > {r.merge_tolerance:.3g}")
    if r.tensors_mismatched:
        parts.append(f"{len(r.tensors_mismatched)} written tensors differ from the merge "
                     f"({', '.join(r.tensors_mismatched[:3])}...)")
    if not r.tensors_checked:
        parts.append("no written tensor could be compared with the merge")
    return "; ".join(parts) or "unknown"


def failure_text(r: ExportResult) -> str:
    return (f"The merge check of this export FAILED: {why_failed(r)}.\n"
            f"Numbers: max |dlogit| {r.max_abs_diff}, tolerance {r.tolerance}, fp32 merge {r.merge_abs_diff}, "
            f"adapter effect {r.adapter_effect}, max |logit| {r.max_abs_logit}.\n"
            "Do not use this model as a faithful merge of the adapter. See delft_export.json.\n")


def export_info(r: ExportResult, info: dict) -> dict:
    return {"delft_version": __version__, "run_info": {k: info.get(k) for k in (
        "base_model", "quantization", "loss", "loss_weight", "step", "total_steps", "status")},
            "prompts": list(CHECK_PROMPTS), **asdict(r)}


def summary_table(r: ExportResult) -> Table:
    table = Table(title="delft export", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    verdict = "[green]passed[/]" if r.passed else f"[bold red]FAILED[/] ({MARKER} written)"
    rows = [
        ("base", r.base_model),
        ("adapter", r.run_dir),
        ("merge", r.merge + (f" ({r.roundtripped_layers} layers)" if r.roundtripped_layers else "")),
        ("dtype", r.dtype),
        ("shards", str(r.shards)),
        ("size", f"{human_size(r.size_bytes)} ({r.n_params:,} parameters)"),
        ("max |Δlogit|", f"{r.max_abs_diff:.3g} (tolerance {r.tolerance:.3g}; reloaded {r.dtype} vs base + adapter)"
         if r.max_abs_diff is not None else "-"),
        ("fp32 merge |Δlogit|", f"{r.merge_abs_diff:.3g} (tolerance {r.merge_tolerance:.3g})"),
        (("training effect" if r.merge == FULL_MODEL else "adapter effect"),
         (f"{r.adapter_effect:.3g}" if r.adapter_effect is not None else "- (starting weights not found)")
         + f" (max |logit| {r.max_abs_logit:.3g})"),
        ("tensors", f"{r.tensors_checked - len(r.tensors_mismatched)}/{r.tensors_checked} bit-identical to the merge"),
        ("verdict", verdict),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


FULL_MODEL = "full model"  # ExportResult.merge of a fully fine-tuned run: copied, nothing merged


CHECK_PROMPTS = ("What is 17 * 23?", "Q: 1,250.5 - 93 =\nA:", "The 3 boxes hold 12, 40 and 7 apples.")


MARKER = "MERGE_CHECK_FAILED.txt"


@dataclass
class ExportResult:
    out: str
    run_dir: str
    base_model: str
    merge: str  # short: "16-bit", "nf4 round-trip", "dequantised GGUF", ...
    merge_detail: str  # one sentence for people
    dtype: str
    shards: int = 0
    size_bytes: int = 0
    n_params: int = 0
    max_abs_diff: Optional[float] = None  # reloaded directory vs base + adapter (fp32)
    merge_abs_diff: Optional[float] = None  # merged in memory (fp32) vs base + adapter
    adapter_effect: Optional[float] = None  # base + adapter vs base alone
    max_abs_logit: Optional[float] = None
    tolerance: Optional[float] = None
    merge_tolerance: Optional[float] = None
    tensors_checked: int = 0
    tensors_mismatched: list = field(default_factory=list)
    roundtripped_layers: int = 0
    passed: bool = False
    notes: list = field(default_factory=list)
