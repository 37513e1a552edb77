"""The training loop: recipe -> QLoRA adapter, with checkpoints, exact resume and a live display.

A plain loop rather than HF Trainer, because delft's loss needs the whole optimizer batch's counts before
the first micro-batch (so CE and the digit term are each a mean over the optimizer batch, independent of
how it is split into micro-batches) and works from hidden states, never full-vocabulary logits.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft.errors import UserError
from delft import rundir
from delft.recipe import Recipe, dump_recipe, load_recipe, recipe_differences
from delft.rundir import latest_checkpoint, write_atomic


# ----------------------------------------------------------------------------- run directory


# Keys a resumed run may change: schedule length and bookkeeping, and how the loss is computed (chunk size, Liger
# or not: the same numbers, tests/test_liger.py), so a run started on a GPU can finish where Liger is missing.
RESUME_FREE_KEYS = ("train.max_steps", "train.epochs", "train.logging_steps", "train.eval_steps",
                    "train.save_steps", "train.keep_checkpoints", "train.loss_chunk_size", "train.fused_loss",
                    "eval")


def prepare_run_dir(recipe: Recipe, resume: Optional[bool], force: bool,
                    console: Console) -> tuple[Path, Optional[Path], bool]:
    """(run dir, checkpoint to resume or None, replace the existing dir?): a fresh run or a resume.

    Never overwrites a user's run without --force, and even then only later, once the model and data have
    loaded (``replace_run_dir``): a recipe mistake found while setting up must not cost the old run.
    """
    run_dir = Path(recipe.output.dir)
    check_replaceable(run_dir)
    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    status = rundir.status(run_dir) if run_dir.is_dir() else None
    if force and exists:
        if not rundir.is_run_dir(run_dir):
            raise UserError(f"--force replaces only a delft run directory, and {run_dir} is not one (it has no "
                            f"{rundir.RUN_INFO})", "output.dir",
                            "Point output.dir at a new directory or an earlier run; delft never deletes other data.")
        return run_dir, None, True
    if resume is True and ckpt is None:
        raise UserError(f"--resume was given but {run_dir} holds no checkpoint", "output.dir",
                        "Drop --resume to start a new run.")
    if exists and status == rundir.COMPLETED:
        raise UserError(f"{run_dir} already holds a finished run", "output.dir",
                        "Choose another output.dir (e.g. --set output.dir=runs/new) or pass --force to replace it.")
    if ckpt is not None and resume is not False:
        saved = load_recipe(run_dir / rundir.RECIPE)
        diff = recipe_differences(saved, recipe, RESUME_FREE_KEYS)
        if diff:
            raise UserError(f"{run_dir} holds a checkpoint of a run with a different recipe ({', '.join(diff)} "
                            "differ)", "output.dir",
                            "Use another output.dir, restore the recipe, or pass --force to start over.")
        console.print(f"[bold cyan]Resuming[/] from {ckpt} (pass --no-resume --force to start over).")
        return run_dir, ckpt, False
    if exists:
        what = "an interrupted run" if ckpt else "files"
        raise UserError(f"{run_dir} already exists and holds {what}", "output.dir",
                        "Choose another output.dir or pass --force to replace it.")
    return run_dir, None, False


def check_replaceable(run_dir: Path) -> None:
    """Refuse an output.dir that is no place for a run: the current directory, one above it, home, a file."""
    where = run_dir.expanduser().resolve()
    here = Path.cwd().resolve()
    if str(run_dir).strip() in ("", ".") or where == here or where in here.parents or where == Path.home().resolve():
        raise UserError(f"output.dir {str(run_dir)!r} is {where}, which holds the current directory or your home",
                        "output.dir", "Name a directory of its own for the run, e.g. output.dir: runs/my-run.")
    if where.exists() and not where.is_dir():
        raise UserError(f"{run_dir} exists and is not a directory", "output.dir",
                        "Choose another output.dir; delft does not replace files.")


def replace_run_dir(run_dir: Path, console: Console) -> None:
    console.print(f"[yellow]--force: replacing {run_dir}[/]")
    shutil.rmtree(run_dir)


# ----------------------------------------------------------------------------- schedule of batches


@dataclass
class Plan:
    micro_per_epoch: int
    total_steps: int
    warmup_steps: int


def make_plan(recipe: Recipe, n_train: int) -> Plan:
    t = recipe.train
    micro = math.ceil(n_train / t.batch_size)
    total = t.max_steps or max(1, math.ceil(t.epochs * micro / t.grad_accum))
    return Plan(micro, total, int(round(t.warmup_ratio * total)))


def micro_batch_items(train, recipe: Recipe, plan: Plan, index: int):
    """The index-th micro-batch of the endless, per-epoch shuffled stream (deterministic for resume)."""
    epoch, k = divmod(index, plan.micro_per_epoch)
    order = list(range(len(train)))
    random.Random(recipe.train.seed * 7919 + epoch).shuffle(order)
    bs = recipe.train.batch_size
    return [train[i] for i in order[k * bs:(k + 1) * bs]]


# ----------------------------------------------------------------------------- one optimizer step


def forward_sums(model, batch: dict, spec, chunk_size: int, fused: bool = False) -> dict:
    """Hidden states from the decoder, then CE and the digit term as sums (see delft.losses)."""
    from delft.losses import loss_sums
    from delft.models import decoder_and_head

    decoder, head = decoder_and_head(model)
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    hidden = decoder(input_ids=batch["input_ids"], use_cache=False, **kwargs).last_hidden_state
    return loss_sums(hidden[:, :-1], head, batch["labels"][:, 1:], spec, chunk_size, fused)


def optimizer_step(model, batches: list[dict], spec, recipe: Recipe, device: str, fused: bool = False) -> dict:
    """Backward over the micro-batches with global normalisation; returns the step's mean CE and term."""
    from delft.losses import count_items

    counts = [count_items(b["labels"][:, 1:], spec.vocab) for b in batches]
    n_labels = max(1, sum(c[0] for c in counts))
    n_digits = sum(c[1] for c in counts)
    ce_total = term_total = 0.0
    for b in batches:
        b = {k: v.to(device) for k, v in b.items()}
        sums = forward_sums(model, b, spec, recipe.train.loss_chunk_size, fused)
        loss = sums["ce_sum"] / n_labels
        if spec.weight > 0 and n_digits > 0:
            loss = loss + spec.weight * sums["term_sum"] / n_digits
        loss.backward()
        ce_total += float(sums["ce_sum"].detach())
        term_total += float(sums["term_sum"].detach())
    return {"ce": ce_total / n_labels, "term": term_total / n_digits if n_digits else 0.0,
            "tokens": sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                          for b in batches), "n_digits": n_digits}


def evaluate_loss(model, val, recipe: Recipe, spec, pad_id: int, device: str) -> dict:
    import torch

    from delft.data import collate
    from delft.losses import count_items

    model.eval()
    ce = term = 0.0
    n_labels = n_digits = 0
    with torch.no_grad():
        for i in range(0, len(val), recipe.train.batch_size):
            b = {k: v.to(device) for k, v in collate(val[i:i + recipe.train.batch_size], pad_id).items()}
            sums = forward_sums(model, b, spec, recipe.train.loss_chunk_size)
            nl, nd = count_items(b["labels"][:, 1:], spec.vocab)
            ce += float(sums["ce_sum"])
            term += float(sums["term_sum"])
            n_labels += nl
            n_digits += nd
    model.train()
    ce /= max(1, n_labels)
    term = term / n_digits if n_digits else 0.0
    return {"val_ce": ce, "val_term": term, "val_loss": ce + spec.weight * term}


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(run_dir: Path, model, optimizer, scheduler, step: int, keep: int) -> Path:
    """Adapter + optimizer + scheduler + RNG, written to a temporary folder and renamed: never half-written."""
    import torch

    final = rundir.checkpoint_path(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    torch.save(state, tmp / rundir.STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in rundir.checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, model, optimizer, scheduler) -> int:
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"checkpoint {ckpt} does not match the model ({len(unexpected)} unexpected keys)",
                        "output.dir", "Use --force to start over.")
    state = torch.load(ckpt / rundir.STATE_FILE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return int(state["step"])


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, forget log lines written after the checkpoint (they will be written again)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
    write_atomic(path, "".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------- reporting


def peak_memory_gb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def plot_losses(metrics_path: Path, out: Path, term_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
        ax.plot([r["step"] for r in train], [r["ce"] for r in train], label="train CE", alpha=0.6)
        if term_name != "ce":
            ax.plot([r["step"] for r in train], [r["term"] for r in train], label=f"train {term_name} term",
                    alpha=0.6)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)


# ----------------------------------------------------------------------------- the whole run


@dataclass
class Setup:
    """Everything a run needs, built from the recipe (tokenizer and data before any weights load)."""

    recipe: Recipe
    device: str
    quantization: str
    tokenizer: object
    spec: object
    train: list
    val: list
    stats: object
    model_ref: object


def setup(recipe: Recipe, console: Console) -> Setup:
    from delft.data import build_datasets
    from delft.digits import DigitVocab
    from delft.losses import make_term
    from delft.models import load_tokenizer, resolve_device, resolve_model, resolve_quantization

    device = resolve_device(recipe.model.device)
    quant = resolve_quantization(recipe.quantization.mode, device)
    ref = resolve_model(recipe.model.name, recipe.model.revision)
    tokenizer = load_tokenizer(ref.path, recipe.model.revision, recipe.model.trust_remote_code)
    if recipe.loss.type != "ce":
        vocab = DigitVocab.from_tokenizer(tokenizer, purpose=f"loss.type {recipe.loss.type!r}")
    else:
        try:
            vocab = DigitVocab.from_tokenizer(tokenizer)
        except UserError:
            vocab = None  # CE needs no digit tokens; counts are just not reported
    spec = make_term(recipe.loss, vocab)
    train, val, stats = build_datasets(recipe.data, tokenizer, recipe.train.seed,
                                       set(vocab.digit_ids) if vocab else None)
    return Setup(recipe, device, quant, tokenizer, spec, train, val, stats, ref)


def build_model(s: Setup, console: Console):
    """(model with LoRA, dtype, Liger kernels in use: [] or ["fused_linear_ce", "rms_norm", ...])."""
    from delft.losses import resolve_fused
    from delft.models import apply_liger_layers, apply_lora, load_model, resolve_dtype

    r = s.recipe
    dtype = resolve_dtype(r.model.dtype, s.device)
    import torch

    torch.manual_seed(r.train.seed)  # LoRA's A matrices are random: same seed, same init
    model = load_model(s.model_ref, s.device, dtype, s.quantization, r.quantization.double_quant,
                       r.model.revision, r.model.trust_remote_code)
    kernels = ["fused_linear_ce"] + apply_liger_layers(model) if resolve_fused(r.train.fused_loss, s.device) else []
    if kernels:
        console.print(f"[bold]kernels[/] Liger {', '.join(kernels)}")
    model = apply_lora(model, r.lora, r.train.gradient_checkpointing, r.quantization.kbit_upcast)
    model.train()  # HF skips gradient checkpointing in eval mode (gpu.md: 25 GiB instead of 8.6)
    return model, dtype, kernels


def describe(s: Setup, model, dtype, console: Console) -> None:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    st = s.stats
    chosen = "(auto)" if s.recipe.quantization.mode == "auto" else ""
    console.print(f"[bold]model[/] {s.recipe.model.name} {('- ' + s.model_ref.note) if s.model_ref.note else ''}")
    console.print(f"  device {s.device}, dtype {str(dtype).replace('torch.', '')}, quantization {s.quantization} "
                  f"{chosen}, LoRA r={s.recipe.lora.r}: {trainable:,} trainable of {total:,} parameters")
    console.print(f"[bold]data[/] {st.examples} examples -> {st.train} train / {st.val} validation; "
                  f"{st.label_tokens:,} trainable labels, {st.digit_labels:,} digit labels "
                  f"({st.digit_labels / max(1, st.label_tokens):.0%})")
    if st.truncated:
        console.print(f"  [yellow]{st.truncated} examples were truncated to data.max_length={s.recipe.data.max_length}[/]")
    if st.fully_masked:
        console.print(f"  [yellow]{st.fully_masked} examples had no trainable label and were dropped[/]")
    lt = s.recipe.loss
    term = "none" if lt.type == "ce" else f"{lt.type} x {lt.weight:g}"
    console.print(f"[bold]loss[/] CE + {term} (each a mean over the optimizer batch)")


def run_training(recipe: Recipe, resume: Optional[bool] = None, force: bool = False,
                 console: Optional[Console] = None, resume_command: str = "delft train RECIPE.yaml") -> Path:
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from transformers import get_scheduler

    from delft.data import collate, collate_packed
    from delft.rundir import architecture

    console = console or Console()
    run_dir, ckpt, replace = prepare_run_dir(recipe, resume, force, console)
    random.seed(recipe.train.seed)
    s = setup(recipe, console)
    model, dtype, kernels = build_model(s, console)
    fused = bool(kernels)
    describe(s, model, dtype, console)

    t = recipe.train
    plan = make_plan(recipe, len(s.train))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    scheduler = get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=plan.warmup_steps,
                              num_training_steps=plan.total_steps)
    if replace:
        replace_run_dir(run_dir, console)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / rundir.METRICS
    start = 0
    if ckpt is not None:
        start = load_checkpoint(ckpt, model, optimizer, scheduler)
        _truncate_metrics(metrics_path, start)
    write_atomic(run_dir / rundir.RECIPE, dump_recipe(recipe))
    info = {"status": rundir.RUNNING, "base_model": s.model_ref.portable_name(), "base_model_path": s.model_ref.path,
            "architecture": architecture(model.get_base_model().config), "quantization": s.quantization,
            "loss": recipe.loss.type, "loss_weight": recipe.loss.weight, "step": start,
            "total_steps": plan.total_steps, "liger_kernels": kernels, "data": asdict(s.stats)}
    rundir.write_info(run_dir, info)
    pad_id = s.tokenizer.pad_token_id

    def batch(index):
        items = micro_batch_items(s.train, recipe, plan, index)
        if recipe.data.packing:
            return collate_packed(items, pad_id, recipe.data.max_length)
        return collate(items, pad_id)

    term_name = recipe.loss.type.upper() if recipe.loss.type != "ce" else "digit"
    console.print(f"[bold]training[/] {plan.total_steps} steps x {t.grad_accum} micro-batches of {t.batch_size} "
                  f"({plan.micro_per_epoch} micro-batches per epoch), run directory {run_dir}")
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    step = start
    window_tokens, window_start = 0, time.perf_counter()
    with Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[stats]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task("train", total=plan.total_steps, completed=start, stats="")
        try:
            while step < plan.total_steps:
                batches = [batch(step * t.grad_accum + j) for j in range(t.grad_accum)]
                out = optimizer_step(model, batches, s.spec, recipe, s.device, fused)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                window_tokens += out["tokens"]
                loss = out["ce"] + s.spec.weight * out["term"]
                if not math.isfinite(loss):
                    raise UserError(f"the loss became {loss} at step {step}", "train.learning_rate",
                                    "Lower train.learning_rate or use dtype float32; the last checkpoint is kept.")
                stats = f"loss {loss:.4f}  ce {out['ce']:.4f}  {term_name} {out['term']:.4f}"
                rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                progress.update(task, completed=step,
                                stats=f"{stats}  {rate:,.0f} tok/s  peak {peak_memory_gb(s.device):.2f} GB")
                if step % t.logging_steps == 0 or step == plan.total_steps:
                    elapsed = time.perf_counter() - window_start
                    row = {"step": step, "loss": loss, "ce": out["ce"], "term": out["term"],
                           "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                           "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                           "peak_mem_gb": peak_memory_gb(s.device)}
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    console.print(f"step {step:>5}/{plan.total_steps}  {stats}  lr {row['lr']:.2e}  "
                                  f"{row['tokens_per_s']:,.0f} tok/s  peak {row['peak_mem_gb']:.2f} GB",
                                  highlight=False)
                    window_tokens, window_start = 0, time.perf_counter()
                if s.val and (step % t.eval_steps == 0 or step == plan.total_steps):
                    ev = evaluate_loss(model, s.val, recipe, s.spec, pad_id, s.device)
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({"step": step, **ev}) + "\n")
                    console.print(f"step {step:>5}  validation loss {ev['val_loss']:.4f}  ce {ev['val_ce']:.4f}  "
                                  f"{term_name} {ev['val_term']:.4f}", highlight=False)
                if step % t.save_steps == 0 and step < plan.total_steps:
                    save_checkpoint(run_dir, model, optimizer, scheduler, step, t.keep_checkpoints)
                    rundir.update_info(run_dir, step=step)
        except KeyboardInterrupt:
            progress.stop()
            path = save_checkpoint(run_dir, model, optimizer, scheduler, step, t.keep_checkpoints)
            rundir.update_info(run_dir, step=step, status=rundir.INTERRUPTED)
            console.print(f"\n[yellow]Interrupted.[/] Saved {path} (step {step}/{plan.total_steps}). "
                          f"Resume with: {resume_command}")
            raise SystemExit(130)

    finish(run_dir, model, s.tokenizer, step, recipe, console, metrics_path)
    return run_dir


def finish(run_dir: Path, model, tokenizer, step: int, recipe: Recipe, console: Console, metrics_path: Path):
    """Adapter and tokenizer at the top of the run directory (PeftModel.from_pretrained(run_dir) loads it)."""
    tmp = run_dir / ".final-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        os.replace(f, run_dir / f.name)
    tmp.rmdir()
    if metrics_path.is_file():
        plot_losses(metrics_path, run_dir / rundir.LOSS_CURVE, recipe.loss.type)
    rundir.update_info(run_dir, step=step, status=rundir.COMPLETED)
    shutil.rmtree(rundir.checkpoints_root(run_dir), ignore_errors=True)
    console.print(f"[bold green]done[/] adapter, tokenizer, metrics.jsonl and loss_curve.png in {run_dir}")
