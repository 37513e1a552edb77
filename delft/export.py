"""``delft export``: merge a run's LoRA adapter into its base model, write a standalone model, verify it.

The base is always loaded unquantised, in fp32, and the adapter merged there (merging into a 4-bit model
degrades quality: transformers#31293, peft#2321). For QLoRA runs there are two choices of weights to merge
into: the original 16-bit weights (default; what ``delft eval RUN`` measures, since it loads the base
unquantised too) or, with ``--match-training``, the nf4 round-trip of every layer bitsandbytes quantised
in training (what the adapter was trained against). The result is cast to the export dtype, written
(sharded safetensors, config, generation config, tokenizer, model card) into a temporary sibling of
``--out`` and renamed into place at the end, so an interrupted export leaves nothing half-written.

Verification, always reported:
  * merge   - the merged model in memory (fp32) vs base + adapter unmerged (fp32): the merge arithmetic.
  * files   - every tensor in the written safetensors equals the merged weights cast to the dtype.
  * reload  - the directory reloaded with plain transformers in fp32 vs base + adapter unmerged:
              ``max |dlogit|``, the headline number, checked against the tolerance of the dtype.
A failed check keeps the output, marked with MERGE_CHECK_FAILED.txt, and exits 1.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from delft.errors import UserError, VerificationError
from delft.models import GGUF_SOURCE
from delft.outputs import check_writable_dir, follow_umask
from delft.rundir import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, COMPLETED, RECIPE, RUN_INFO, check_model_files,
                          has_adapter, read_info)

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Default tolerance on max |dlogit| = REL_TOLERANCE[dtype] * max(1, max |logit| of base + adapter).
#  fp32: only summation order differs between W x + B(A x) and (W + BA) x: ~1e-6 relative; 1e-4 leaves room
#        for deep models without hiding a wrong merge (a missing or mis-scaled adapter moves logits far more).
#  bf16: 8-bit mantissa, each weight rounded by up to 2^-9 (0.2 %); through a few dozen layers that moves
#        logits by ~1 % of their scale. 5 % is clear of that noise; the fp32 merge check and the bit-exact
#        file check catch a wrong merge that small noise could hide.
#  fp16: 11-bit mantissa, 8x finer than bf16: 1 %.
REL_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.01}
MERGE_REL_TOLERANCE = 1e-4  # the in-memory fp32 merge, whatever the export dtype
CHECK_PROMPTS = ("What is 17 * 23?", "Q: 1,250.5 - 93 =\nA:", "The 3 boxes hold 12, 40 and 7 apples.")
MARKER = "MERGE_CHECK_FAILED.txt"
EXPORT_INFO = "delft_export.json"
DISK_MARGIN = 1.1


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


# ----------------------------------------------------------------------------- argument checks


def normalize_dtype(name: str) -> str:
    key = str(name).lower().replace("torch.", "")
    if key not in DTYPES:
        raise UserError(f"unknown dtype {name!r}", "--dtype", "Use bfloat16 (default), float16 or float32.")
    return DTYPES[key]


def check_run_dir(run_dir: Path) -> dict:
    """The run's delft_run.json (may be empty for adapters not written by delft); refuses dirs with no adapter."""
    if not run_dir.exists():
        raise UserError(f"run directory {run_dir} does not exist", "delft export",
                        "Give the output.dir of a finished `delft train` run.")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory", "delft export",
                        "Give the output.dir of a finished `delft train` run.")
    info = read_info(run_dir)
    if not has_adapter(run_dir):
        hint = (f" (its {RUN_INFO} says status {info.get('status')!r}: finish or resume the training first)"
                if info.get("status") not in (None, COMPLETED) else "")
        raise UserError(f"{run_dir} holds no adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS[0]}){hint}",
                        "delft export", "Give the output.dir of a finished `delft train` run.")
    check_model_files(run_dir, "delft export", "Restore the file, or train the run again.")
    return info


def _within(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


def check_out(out: Path, force: bool, protected: dict[str, Path]) -> None:
    """Refuse a non-empty --out without --force, and any --out whose replacement would delete an input."""
    for what, path in protected.items():
        if path is not None and path.exists() and _within(path, out):
            raise UserError(f"--out {out} contains the {what} ({path}); replacing it would delete it", "--out",
                            "Choose a new directory, e.g. --out merged/NAME.")
    if out.exists() and not force:
        if out.is_dir() and not any(out.iterdir()):
            return
        kind = "a non-empty directory" if out.is_dir() else "a file"
        raise UserError(f"{out} already exists and is {kind}", "--out",
                        "Choose another --out or pass --force to replace it.")
    check_writable_dir(out.parent, "--out")
    _check_no_other_export(out)


def _local_param_count(path: str) -> Optional[int]:
    """Parameters in a local model directory's safetensors files (headers only); None when not knowable."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    total = 0
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    n = 1
                    for d in sf.get_slice(k).get_shape():
                        n *= d
                    total += n
    except Exception:
        return None
    return total


def check_disk(out: Path, n_params: int, dtype: str) -> int:
    """Refuse when the filesystem holding --out has less than n_params * bytes * 1.1 free; returns the estimate."""
    need = int(n_params * DTYPE_BYTES[dtype] * DISK_MARGIN)
    where = out.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"not enough free disk space in {where}: the merged model needs about {_size(need)} "
                        f"({n_params:,} parameters x {DTYPE_BYTES[dtype]} bytes in {dtype} + 10 %), "
                        f"{_size(free)} is free", "--out",
                        "Free some space, choose --out on another disk"
                        + (", or export --dtype bfloat16 (half the size)." if dtype == "float32" else "."))
    return need


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ----------------------------------------------------------------------------- nf4 round trip


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


# ----------------------------------------------------------------------------- logits and checks


def _logits(model, encoded: list) -> list:
    import torch

    with torch.no_grad():
        return [model(input_ids=ids).logits.float().cpu() for ids in encoded]


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _check_files(directory: Path, state: dict) -> tuple[int, list[str], int]:
    """(tensors compared, names that differ, names not found in the merged model) for the written shards."""
    import torch
    from safetensors import safe_open

    checked, bad, unknown = 0, [], 0
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k not in state:
                    unknown += 1
                    continue
                t = sf.get_tensor(k)
                ref = state[k].detach().to("cpu")
                checked += 1
                if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref):
                    bad.append(k)
    return checked, bad, unknown


# ----------------------------------------------------------------------------- model card


def _load_recipe_quietly(run_dir: Path):
    from delft.recipe import load_recipe

    path = run_dir / RECIPE
    if not path.is_file():
        return None
    try:
        return load_recipe(path)
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
    keys = ("n", "exact_match", "tolerance_match", "digit_accuracy", "mae", "no_number_rate")

    def fmt(metrics: dict) -> str:
        parts = []
        for k in keys:
            v = metrics.get(k)
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, (int, float)):
                rate = k in ("exact_match", "tolerance_match", "digit_accuracy", "no_number_rate")
                parts.append(f"{k} {v:.1%}" if rate else f"{k} {v:g}")
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
    from delft.models import HUB_ID

    return bool(re.fullmatch(HUB_ID, name)) and not Path(name).expanduser().exists()


def model_card(r: ExportResult, info: dict, recipe, evals: list, run_dir: Path) -> str:
    loss = info.get("loss") or (recipe.loss.type if recipe else "?")
    weight = info.get("loss_weight", recipe.loss.weight if recipe else None)
    loss_text = "cross-entropy only" if loss == "ce" else f"CE + lambda x {loss} with lambda = {weight:g}" \
        if isinstance(weight, (int, float)) else str(loss)
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


# ----------------------------------------------------------------------------- the export


def _describe_merge(info: dict, match_training: bool, gguf: bool) -> tuple[str, str, list[str]]:
    quant = info.get("quantization")
    notes = []
    if match_training:
        short = "nf4 round-trip"
        detail = "into the nf4 round-trip (quantise + dequantise) of the base weights"
        if quant == "nf4":
            detail += ", what this QLoRA adapter was trained against (--match-training)"
        else:
            detail += " (--match-training)"
            notes.append(f"This run was not quantised (quantization {quant or 'unknown'}): its adapter was trained "
                         "against the plain weights. The nf4 round-trip was applied because --match-training asked "
                         "for it; drop the flag for the merge that matches training.")
    else:
        short = "16-bit"
        detail = "into the original base weights"
        if quant == "nf4":
            detail += " (the QLoRA adapter was trained on their nf4 round-trip; --match-training merges into that)"
            notes.append("QLoRA run: merged into the unquantised base weights, the base `delft eval RUN` loads. "
                         "--match-training merges into their nf4 round-trip, which the adapter was trained on.")
    if gguf:
        short = "dequantised GGUF" + (" + nf4 round-trip" if match_training else "")
        detail = detail.replace("the base weights", "the base weights dequantised from GGUF").replace(
            "the original base weights", "the base weights dequantised from GGUF")
        notes.append("The base model is a GGUF file: the adapter was merged into its dequantised weights, so the "
                     "merged model carries the GGUF quantisation error of the base.")
    return short, detail, notes


@dataclass
class _Base:
    """The base model an export merges into, and the run's settings it is loaded with."""

    name: str
    ref: object  # delft.models.ModelRef
    config: object  # transformers config
    recipe: object  # the run's Recipe, or None when its recipe.yaml is unreadable
    revision: Optional[str]
    remote: bool
    gguf: bool


def _check_arguments(dtype: str, tolerance: Optional[float], device: str) -> str:
    """The normalised dtype; refuses a negative or NaN tolerance and an unknown device."""
    dtype = normalize_dtype(dtype)
    if tolerance is not None and (tolerance != tolerance or tolerance < 0):
        raise UserError(f"tolerance must be a number >= 0, not {tolerance}", "--tolerance",
                        "Leave it out for the default of the dtype.")
    if device not in ("cpu", "cuda", "auto"):
        raise UserError(f"unknown device {device!r}", "--device", "Use cpu or cuda.")
    return dtype


def _resolve_base(run_dir: Path, out: Path, force: bool, dtype: str) -> tuple[dict, _Base, Optional[int]]:
    """(run info, the base, its parameter count when the files tell it); every refusal before loading weights."""
    from transformers import AutoConfig

    from delft.models import SMOLLM2_ALIAS, resolve_model
    from delft.rundir import base_model, check_adapter_matches

    info = check_run_dir(run_dir)
    name = base_model(run_dir)
    if not name:
        raise UserError(f"{run_dir} does not say which base model its adapter belongs to", "delft export",
                        f"Check the run's {RUN_INFO} (base_model).")
    check_out(out, force, {"run directory": run_dir})
    recipe = _load_recipe_quietly(run_dir)
    revision = recipe.model.revision if recipe else None
    remote = recipe.model.trust_remote_code if recipe else False
    ref = resolve_model(name, revision)
    if ref.is_local:
        check_out(out, force, {"run directory": run_dir, "base model": Path(ref.path)})
    gguf = name.endswith(".gguf") or name == SMOLLM2_ALIAS or (Path(ref.path) / GGUF_SOURCE).is_file()
    try:
        config = AutoConfig.from_pretrained(ref.path, revision=revision, trust_remote_code=remote)
    except (OSError, ValueError) as e:
        raise UserError(f"could not read the config of base model {name!r}: {str(e).splitlines()[0]}",
                        "delft export", f"Check the base recorded in the run's {RUN_INFO}.") from None
    if getattr(config, "quantization_config", None):
        raise UserError(f"base model {name!r} is a pre-quantised checkpoint; merging into 4-bit weights degrades "
                        "the model", "delft export", "Train and export against the 16-bit model it was made from.")
    check_adapter_matches(run_dir, name, config, "delft export")
    estimate = _local_param_count(ref.path) if ref.is_local else None
    if estimate:
        check_disk(out, estimate, dtype)
    return info, _Base(name, ref, config, recipe, revision, remote, gguf), estimate


def _announce(run_dir: Path, out: Path, base: _Base, info: dict, detail: str, notes: list[str], dtype: str,
              device: str, console: Console) -> None:
    from delft.rundir import COMPLETED

    console.print(f"[bold]export[/] {run_dir} -> {out}")
    console.print(f"  base {base.name}{(' - ' + base.ref.note) if base.ref.note else ''}; merge {detail}; "
                  f"dtype {dtype}; device {device}", highlight=False)
    if info.get("status") not in (None, COMPLETED):
        notes.append(f"The run's status is {info.get('status')!r}, not {COMPLETED!r}.")
    if base.recipe is None:
        notes.append(f"The run has no readable {RECIPE}: recipe summary left out, double quantisation assumed on.")
    for n in notes:
        console.print(f"  [yellow]note[/] {n}", highlight=False)


def _merge(run_dir: Path, base: _Base, device: str, match_training: bool, encoded: list, console: Console):
    """Base (fp32, optionally nf4 round-tripped) + adapter merged in memory.

    Returns (merged model, base + adapter logits, adapter effect, fp32 merge difference, n_params, layers
    round-tripped); the logits are the reference every check compares with.
    """
    import torch
    from peft import PeftModel

    from delft.models import load_model

    model = load_model(base.ref, device, torch.float32, "none", revision=base.revision,
                       trust_remote_code=base.remote)
    n_params = sum(p.numel() for p in model.parameters())
    roundtripped = 0
    if match_training:
        double_quant = base.recipe.quantization.double_quant if base.recipe else True
        roundtripped = apply_nf4_roundtrip(model, double_quant)
        console.print(f"  nf4 round-trip (blocksize 64, double quant {'on' if double_quant else 'off'}) of "
                      f"{roundtripped} linear layers", highlight=False)
    try:
        peft_model = PeftModel.from_pretrained(model, str(run_dir))
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"the adapter in {run_dir} does not fit {base.name!r}: {str(e).splitlines()[0]}",
                        "delft export", "Export it with the base model it was trained on.") from None
    peft_model.eval()
    reference = _logits(peft_model, encoded)
    with peft_model.disable_adapter():
        adapter_effect = _max_diff(reference, _logits(peft_model, encoded))
    merged = peft_model.merge_and_unload()
    merged.eval()
    merge_diff = _max_diff(_logits(merged, encoded), reference)
    return merged, reference, adapter_effect, merge_diff, n_params, roundtripped


def _save(tmp: Path, merged, tokenizer, result: ExportResult, max_shard_size: str) -> None:
    """The merged model in the export dtype and the tokenizer into ``tmp``; every written tensor checked."""
    import torch

    merged.to(getattr(torch, result.dtype))
    merged.config.use_cache = True
    merged.save_pretrained(tmp, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(tmp)
    result.tensors_checked, result.tensors_mismatched, unknown = _check_files(tmp, merged.state_dict())
    if unknown:
        result.notes.append(f"{unknown} tensors in the files have names the merged model does not use "
                            "(not compared bit for bit; the reload check covers them).")
    shards = sorted(tmp.glob("*.safetensors"))
    result.shards = len(shards)
    result.size_bytes = sum(f.stat().st_size for f in shards)


def _verify_reload(tmp: Path, encoded: list, reference: list, result: ExportResult, base: _Base, device: str) -> None:
    """Reload ``tmp`` with plain transformers (fp32) and compare its logits with base + adapter."""
    import torch
    from transformers import AutoModelForCausalLM

    from delft.generate import free_memory

    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32,
                                                    trust_remote_code=base.remote).to(device).eval()
    result.max_abs_diff = _max_diff(_logits(reloaded, encoded), reference)
    del reloaded
    free_memory()
    result.passed = (result.max_abs_diff <= result.tolerance and result.merge_abs_diff <= result.merge_tolerance
                     and not result.tensors_mismatched and result.tensors_checked > 0)


def run_export(run_dir, out, dtype: str = "bfloat16", match_training: bool = False,
               tolerance: Optional[float] = None, device: str = "cpu", force: bool = False,
               console: Optional[Console] = None, max_shard_size: str = "2GB") -> ExportResult:
    """Merge the adapter in ``run_dir`` into its base model and write a standalone model to ``out``.

    Raises UserError for what the user can fix, VerificationError (exit 1) when the merge check fails -
    in which case ``out`` is still written, marked with MERGE_CHECK_FAILED.txt.
    """
    from delft.generate import free_memory
    from delft.models import load_tokenizer, resolve_device
    from delft.rundir import tokenizer_source

    console = console or Console()
    run_dir, out = Path(run_dir), Path(out)
    dtype = _check_arguments(dtype, tolerance, device)
    info, base, estimate = _resolve_base(run_dir, out, force, dtype)
    device = resolve_device(device)
    short, detail, notes = _describe_merge(info, match_training, base.gguf)
    _announce(run_dir, out, base, info, detail, notes, dtype, device, console)

    tok_path = tokenizer_source(run_dir, base.ref.path)
    tokenizer = load_tokenizer(tok_path, None if tok_path == str(run_dir) else base.revision, base.remote)
    encoded = [tokenizer(p, return_tensors="pt")["input_ids"].to(device) for p in CHECK_PROMPTS]
    merged, reference, adapter_effect, merge_diff, n_params, roundtripped = _merge(
        run_dir, base, device, match_training, encoded, console)
    if not estimate:
        check_disk(out, n_params, dtype)
    scale = max(1.0, max(float(x.abs().max()) for x in reference))
    tol = tolerance if tolerance is not None else REL_TOLERANCE[dtype] * scale
    result = ExportResult(out=str(out), run_dir=str(run_dir), base_model=base.name, merge=short, merge_detail=detail,
                          dtype=dtype, n_params=n_params, merge_abs_diff=merge_diff, adapter_effect=adapter_effect,
                          max_abs_logit=max(float(x.abs().max()) for x in reference), tolerance=tol,
                          merge_tolerance=tolerance if tolerance is not None else MERGE_REL_TOLERANCE * scale,
                          roundtripped_layers=roundtripped, notes=notes)
    if adapter_effect <= tol:
        result.notes.append(f"The adapter changes logits by at most {adapter_effect:.3g}, not more than the "
                            f"{dtype} tolerance {tol:.3g}: the reload check alone could not tell it from the base; "
                            "the fp32 merge check and the bit-exact file check still cover the merge.")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(out)}{os.getpid()}-", dir=out.parent))
    try:
        _save(tmp, merged, tokenizer, result, max_shard_size)
        del merged  # its weights go before the reload
        free_memory()
        _verify_reload(tmp, encoded, reference, result, base, device)
        (tmp / "README.md").write_text(model_card(result, info, base.recipe, eval_headline(run_dir), run_dir))
        (tmp / EXPORT_INFO).write_text(json.dumps(_export_info(result, info), indent=2))
        if not result.passed:
            (tmp / MARKER).write_text(_failure_text(result))
        follow_umask(tmp)
        _swap_into_place(tmp, out, force)
    except OSError as e:  # disk full or the directory taken away mid-write: nothing is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write the merged model for {out} ({e.strerror or e})", "--out",
                        "Free some space or choose another --out, then export again.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    console.print(summary_table(result))
    if not result.passed:
        raise VerificationError(f"the merged model in {out} does not reproduce base + adapter: {_why(result)}. "
                                f"The output is kept and marked with {out / MARKER}; do not ship it. Rerun with "
                                "--dtype float32 to tell rounding from a wrong merge, or --tolerance to accept it.")
    console.print(f"[bold green]done[/] merged model in {out} (loads with AutoModelForCausalLM.from_pretrained)")
    return result


def _tmp_prefix(out: Path) -> str:
    """Temporary export directories beside ``out``: this prefix, then the pid of the export writing it."""
    return f".{out.name}.tmp-"


def _check_no_other_export(out: Path) -> None:
    """Refuse, before the merge, an --out another running export is writing (its temporary directory)."""
    for tmp in out.parent.glob(f"{glob.escape(_tmp_prefix(out))}*-*") if out.parent.is_dir() else []:
        pid = tmp.name[len(_tmp_prefix(out)):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            raise UserError(f"another delft export (process {pid}) is writing {out} right now", "--out",
                            "Wait for it to finish, or export to another --out.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _swap_into_place(tmp: Path, out: Path, force: bool = True) -> None:
    """Rename the finished temporary directory to ``out``; an old ``out`` is moved aside first, then deleted.

    Without ``force``, an ``out`` that another process filled meanwhile is kept, and so is this export.
    """
    if not force:
        try:
            os.rename(tmp, out)  # replaces an empty directory, never a full one
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        kept = out.with_name(f"{out.name}.{os.getpid()}")
        os.rename(tmp, kept)
        raise UserError(f"{out} was written by another process while this export ran", "--out",
                        f"This export was kept in {kept}: compare the two, then rename the one to keep.")
    old = None
    if out.exists() or out.is_symlink():
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _why(r: ExportResult) -> str:
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


def _failure_text(r: ExportResult) -> str:
    return (f"The merge check of this export FAILED: {_why(r)}.\n"
            f"Numbers: max |dlogit| {r.max_abs_diff}, tolerance {r.tolerance}, fp32 merge {r.merge_abs_diff}, "
            f"adapter effect {r.adapter_effect}, max |logit| {r.max_abs_logit}.\n"
            "Do not use this model as a faithful merge of the adapter. See delft_export.json.\n")


def _export_info(r: ExportResult, info: dict) -> dict:
    from delft import __version__

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
        ("size", f"{_size(r.size_bytes)} ({r.n_params:,} parameters)"),
        ("max |Δlogit|", f"{r.max_abs_diff:.3g} (tolerance {r.tolerance:.3g}; reloaded {r.dtype} vs base + adapter)"
         if r.max_abs_diff is not None else "-"),
        ("fp32 merge |Δlogit|", f"{r.merge_abs_diff:.3g} (tolerance {r.merge_tolerance:.3g})"),
        ("adapter effect", f"{r.adapter_effect:.3g} (max |logit| {r.max_abs_logit:.3g})"),
        ("tensors", f"{r.tensors_checked - len(r.tensors_mismatched)}/{r.tensors_checked} bit-identical to the merge"),
        ("verdict", verdict),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table
