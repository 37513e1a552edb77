"""``delft export``'s merge: a run's LoRA adapter merged into its base model, written as a standalone model, verified
(the command's whole sequence, GGUF included, is delft.export.command).

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
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft.errors import UserError, VerificationError
from delft.export.checks import check_disk, check_out, check_run_dir, local_param_count, normalize_dtype, tmp_prefix
from delft.export.nf4 import apply_nf4_roundtrip
from delft.export.report import (
    CHECK_PROMPTS,
    FULL_MODEL,
    MARKER,
    ExportResult,
    eval_headline,
    export_info,
    failure_text,
    load_recipe_quietly,
    model_card,
    summary_table,
    why_failed,
)
from delft.models.loading import free_memory, load_model, load_tokenizer, resolve_device
from delft.models.remote_code import check_remote_code
from delft.models.sources import GGUF_SOURCE, SMOLLM2_ALIAS, ModelRef, resolve_model
from delft.outputs import follow_umask, is_disk_full
from delft.rundir import (
    COMPLETED,
    EXPORT_INFO,
    RECIPE,
    RUN_INFO,
    base_model,
    check_adapter_matches,
    check_model_files,
    is_merged_model,
    tokenizer_source,
)

# Default tolerance on max |dlogit| = REL_TOLERANCE[dtype] * max(1, max |logit| of base + adapter).
#  fp32: only summation order differs between W x + B(A x) and (W + BA) x: ~1e-6 relative; 1e-4 leaves room
#        for deep models without hiding a wrong merge (a missing or mis-scaled adapter moves logits far more).
#  bf16: 8-bit mantissa, each weight rounded by up to 2^-9 (0.2 %); through a few dozen layers that moves
#        logits by ~1 % of their scale. 5 % is clear of that noise; the fp32 merge check and the bit-exact
#        file check catch a wrong merge that small noise could hide.
#  fp16: 11-bit mantissa, 8x finer than bf16: 1 %.
REL_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.01}


MERGE_REL_TOLERANCE = 1e-4  # the in-memory fp32 merge, whatever the export dtype


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
    ref: object  # delft.models.sources.ModelRef
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


def _refuse_folder_code(run_dir: Path, name: str, base_dir: Path, remote: bool) -> None:
    """Code the base or the run's tokenizer would run: refused unless the user passed --trust-remote-code. The
    run's own recipe.yaml may say trust_remote_code: true; it is someone else's file and is not obeyed."""
    origin = f"the base recorded in {run_dir / RUN_INFO}"
    check_remote_code(base_dir, name, "delft export", remote, origin)
    if run_dir.resolve() != base_dir.resolve():
        check_remote_code(run_dir, str(run_dir), "delft export", remote, "its tokenizer files")


def _resolve_base(run_dir: Path, out: Path, force: bool, dtype: str,
                  gguf_bytes: float = 0.0, remote: bool = False) -> tuple[dict, _Base, Optional[int]]:
    """(run info, the base, its parameter count when the files tell it); every refusal before loading weights.
    ``remote``: the user's own --trust-remote-code, never a setting read from the run."""
    from transformers import AutoConfig

    info = check_run_dir(run_dir)
    if is_merged_model(run_dir):  # fully fine-tuned: the run is the model (check_run_dir allows it for runs)
        return _full_run(run_dir, out, force, dtype, gguf_bytes, info, remote)
    name = base_model(run_dir)
    if not name:
        raise UserError(f"{run_dir} does not say which base model its adapter belongs to", "delft export",
                        f"Check the run's {RUN_INFO} (base_model).")
    check_out(out, force, {"run directory": run_dir})
    recipe = load_recipe_quietly(run_dir)
    revision = recipe.model.revision if recipe else None
    ref = resolve_model(name, revision)
    if ref.is_local:
        check_out(out, force, {"run directory": run_dir, "base model": Path(ref.path)})
        check_model_files(Path(ref.path), "delft export", f"Check the base recorded in the run's {RUN_INFO}.")
        _refuse_folder_code(run_dir, name, Path(ref.path), remote)
    gguf = name.endswith(".gguf") or name == SMOLLM2_ALIAS or (Path(ref.path) / GGUF_SOURCE).is_file()
    try:
        config = AutoConfig.from_pretrained(ref.path, revision=revision, trust_remote_code=remote)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):  # a hub base whose files are not here to name
            raise UserError(f"base model {name!r} (recorded in {run_dir / RUN_INFO}) loads only by running code "
                            "from its repository, and delft never takes trust_remote_code from a run folder",
                            "delft export", "Read that code first; if you trust it, pass --trust-remote-code.") from None
        raise UserError(f"could not read the config of base model {name!r}: {str(e).splitlines()[0]}",
                        "delft export", f"Check the base recorded in the run's {RUN_INFO}.") from None
    if getattr(config, "quantization_config", None):
        raise UserError(f"base model {name!r} is a pre-quantised checkpoint; merging into 4-bit weights degrades "
                        "the model", "delft export", "Train and export against the 16-bit model it was made from.")
    check_adapter_matches(run_dir, name, config, "delft export")
    estimate = local_param_count(ref.path) if ref.is_local else None
    if estimate:
        check_disk(out, estimate, dtype, gguf_bytes)
    return info, _Base(name, ref, config, recipe, revision, remote, gguf), estimate


def _full_run(run_dir: Path, out: Path, force: bool, dtype: str, gguf_bytes: float,
              info: dict, remote: bool) -> tuple[dict, _Base, Optional[int]]:
    """A fully fine-tuned run as the "base" an export copies: its own config and weights, nothing merged."""
    from transformers import AutoConfig

    check_out(out, force, {"run directory": run_dir})
    check_remote_code(run_dir, str(run_dir), "delft export", remote, "a fully fine-tuned run")
    recipe = load_recipe_quietly(run_dir)
    config = AutoConfig.from_pretrained(str(run_dir), trust_remote_code=remote)
    estimate = local_param_count(str(run_dir))
    if estimate:
        check_disk(out, estimate, dtype, gguf_bytes)
    ref = ModelRef(str(run_dir), str(run_dir), True, "fully fine-tuned run: its weights are copied, nothing merged")
    return info, _Base(info.get("base_model") or str(run_dir), ref, config, recipe, None, remote, False), estimate


def _copy_full(run_dir: Path, base: _Base, info: dict, device: str, encoded: list):
    """The fully fine-tuned model (fp32) as ``_merge`` returns a merge: the reference logits are its own, the
    "adapter effect" is how far training moved them from the starting weights (when those are still there)."""
    import torch

    model = load_model(base.ref, device, torch.float32, "none").eval()
    reference = _logits(model, encoded)
    start = info.get("base_model_path")
    effect = None
    if start and (Path(start) / "config.json").is_file():
        start_model = load_model(ModelRef(start, start, True), device, torch.float32, "none").eval()
        effect = _max_diff(reference, _logits(start_model, encoded))
        del start_model
        free_memory()
    return model, reference, effect, 0.0, sum(p.numel() for p in model.parameters()), 0


def _what_is_merged(run_dir: Path, info: dict, match_training: bool, gguf: bool) -> tuple[str, str, list[str]]:
    """(short, detail, notes) of the merge: ``_describe_merge``'s, or, for a fully fine-tuned run, a copy."""
    if not is_merged_model(run_dir):
        return _describe_merge(info, match_training, gguf)
    if match_training:
        raise UserError("--match-training merges a QLoRA adapter into the nf4 round-trip of its base; this run was "
                        "fully fine-tuned (no adapter, no nf4)", "--match-training", "Drop --match-training.")
    return FULL_MODEL, "none: the fully fine-tuned weights, copied and checked", []


def _announce(run_dir: Path, out: Path, base: _Base, info: dict, detail: str, notes: list[str], dtype: str,
              device: str, console: Console) -> None:

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

    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32,
                                                    trust_remote_code=base.remote).to(device).eval()
    result.max_abs_diff = _max_diff(_logits(reloaded, encoded), reference)
    del reloaded
    free_memory()
    result.passed = (result.max_abs_diff <= result.tolerance and result.merge_abs_diff <= result.merge_tolerance
                     and not result.tensors_mismatched and result.tensors_checked > 0)


def _set_tolerances(result: ExportResult, reference: list, tolerance: Optional[float]) -> None:
    """The reload and merge tolerances of ``result`` (``tolerance`` or the dtype's relative default, scaled by
    the largest logit), with a note when the adapter moves logits less than the reload check can see."""
    largest = max(float(x.abs().max()) for x in reference)
    scale = max(1.0, largest)
    result.max_abs_logit = largest
    result.tolerance = tolerance if tolerance is not None else REL_TOLERANCE[result.dtype] * scale
    result.merge_tolerance = tolerance if tolerance is not None else MERGE_REL_TOLERANCE * scale
    if result.adapter_effect is not None and result.adapter_effect <= result.tolerance:
        result.notes.append(f"The adapter changes logits by at most {result.adapter_effect:.3g}, not more than the "
                            f"{result.dtype} tolerance {result.tolerance:.3g}: the reload check alone could not tell "
                            "it from the base; the fp32 merge check and the bit-exact file check still cover the merge.")


def _write_reports(tmp: Path, result: ExportResult, info: dict, base: "_Base", run_dir: Path) -> None:
    """The model card, the export info and (when the check failed) the marker, into the export being written."""
    (tmp / "README.md").write_text(model_card(result, info, base.recipe, eval_headline(run_dir), run_dir))
    (tmp / EXPORT_INFO).write_text(json.dumps(export_info(result, info), indent=2))
    if not result.passed:
        (tmp / MARKER).write_text(failure_text(result))
    follow_umask(tmp)


def write_merged_model(run_dir, out, dtype: str = "bfloat16", match_training: bool = False,
                       tolerance: Optional[float] = None, device: str = "cpu", force: bool = False,
                       console: Optional[Console] = None, max_shard_size: str = "2GB",
                       gguf_bytes_per_param: float = 0.0, trust_remote_code: bool = False) -> ExportResult:
    """Merge the adapter in ``run_dir`` into its base model and write a standalone model to ``out``.

    Raises UserError for what the user can fix, VerificationError (exit 1) when the merge check fails -
    in which case ``out`` is still written, marked with MERGE_CHECK_FAILED.txt.
    """
    console = console or Console()
    run_dir, out = Path(run_dir), Path(out)
    dtype = _check_arguments(dtype, tolerance, device)
    info, base, estimate = _resolve_base(run_dir, out, force, dtype, gguf_bytes_per_param, trust_remote_code)
    device = resolve_device(device)
    short, detail, notes = _what_is_merged(run_dir, info, match_training, base.gguf)
    _announce(run_dir, out, base, info, detail, notes, dtype, device, console)

    tok_path = tokenizer_source(run_dir, base.ref.path)
    tokenizer = load_tokenizer(tok_path, None if tok_path == str(run_dir) else base.revision, base.remote)
    encoded = [tokenizer(p, return_tensors="pt")["input_ids"].to(device) for p in CHECK_PROMPTS]
    merged, reference, adapter_effect, merge_diff, n_params, roundtripped = (
        _copy_full(run_dir, base, info, device, encoded) if short == FULL_MODEL
        else _merge(run_dir, base, device, match_training, encoded, console))
    if not estimate:
        check_disk(out, n_params, dtype, gguf_bytes_per_param)
    result = ExportResult(out=str(out), run_dir=str(run_dir), base_model=base.name, merge=short, merge_detail=detail,
                          dtype=dtype, n_params=n_params, merge_abs_diff=merge_diff, adapter_effect=adapter_effect,
                          roundtripped_layers=roundtripped, notes=notes)
    _set_tolerances(result, reference, tolerance)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{tmp_prefix(out)}{os.getpid()}-", dir=out.parent))
    try:
        _save(tmp, merged, tokenizer, result, max_shard_size)
        del merged  # its weights go before the reload
        free_memory()
        _verify_reload(tmp, encoded, reference, result, base, device)
        _write_reports(tmp, result, info, base, run_dir)
        _swap_into_place(tmp, out, force)
    except BaseException as e:  # disk full (also in the tokenizer's Rust writer) or the directory taken away
        shutil.rmtree(tmp, ignore_errors=True)  # mid-write: nothing is left behind
        if isinstance(e, OSError) or is_disk_full(e):
            raise UserError(f"could not write the merged model for {out} ({getattr(e, 'strerror', None) or e})",
                            "--out", "Free some space or choose another --out, then export again.") from None
        raise

    console.print(summary_table(result))
    if not result.passed:
        raise VerificationError(f"the merged model in {out} does not reproduce base + adapter: {why_failed(result)}. "
                                f"The output is kept and marked with {out / MARKER}; do not ship it. Rerun with "
                                "--dtype float32 to tell rounding from a wrong merge, or --tolerance to accept it.")
    console.print(f"[bold green]done[/] merged model in {out} (loads with AutoModelForCausalLM.from_pretrained)")
    return result


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


def verified_export(run_dir, out, dtype: str) -> Optional[ExportResult]:
    """An earlier export of ``run_dir`` into ``out`` whose merge check passed (so a failed or interrupted GGUF
    phase can be redone without merging again), or None. Refuses one merged in another dtype than asked."""
    import dataclasses

    out = Path(out)
    info_path = out / EXPORT_INFO
    if not info_path.is_file() or (out / MARKER).exists() or not (out / "config.json").is_file():
        return None
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return None
    if not info.get("passed") or Path(str(info.get("run_dir", ""))).resolve() != Path(run_dir).resolve():
        return None
    if info.get("dtype") != normalize_dtype(dtype):
        raise UserError(f"{out} holds this run's export merged in {info.get('dtype')}, not {normalize_dtype(dtype)}",
                        "--dtype", f"Pass --dtype {info.get('dtype')} to redo only its GGUF phase, or --force to "
                        "merge again.")
    names = {f.name for f in dataclasses.fields(ExportResult)}
    fields = {k: v for k, v in info.items() if k in names}
    fields.update(out=str(out), run_dir=str(run_dir))  # where it is now (it was recorded as typed then)
    return ExportResult(**fields)
