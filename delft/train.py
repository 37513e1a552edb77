"""The training loop: recipe -> QLoRA adapter, with checkpoints, exact resume and a live display.

A plain loop rather than HF Trainer, because delft's loss needs the whole optimizer batch's counts before
the first micro-batch (so CE and the digit term are each a mean over the optimizer batch, independent of
how it is split into micro-batches) and works from hidden states, never full-vocabulary logits.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from delft.errors import UserError
from delft import distributed as dist, rundir
from delft.recipe import Recipe, dump_recipe, load_recipe, recipe_differences
from delft.rundir import latest_checkpoint, write_atomic


# ----------------------------------------------------------------------------- run directory


# Keys a resumed run may change: schedule length and bookkeeping, and how the loss is computed (chunk size, Liger
# or not: the same numbers, tests/test_liger.py), so a run started on a GPU can finish where Liger is missing.
RESUME_FREE_KEYS = ("train.max_steps", "train.epochs", "train.logging_steps", "train.eval_steps",
                    "train.save_steps", "train.keep_checkpoints", "train.loss_chunk_size", "train.fused_loss",
                    "train.accuracy_steps", "train.accuracy_examples", "eval")


def prepare_run_dir(recipe: Recipe, resume: Optional[bool], force: bool,
                    console: Console, stale_pid: Optional[int] = None) -> tuple[Path, Optional[Path], bool]:
    """(run dir, checkpoint to resume or None, replace the existing dir?): a fresh run or a resume.

    Never overwrites a user's run without --force, and even then only later, once the model and data have
    loaded (``Trainer.open_run_dir``): a recipe mistake found while setting up must not cost the old run.
    Called with the run directory's lock held (delft.runlock), so no other training is using it, and after
    ``check_replaceable`` (run_training checks before the lock file is made beside the directory).
    """
    run_dir = Path(recipe.output.dir)
    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    status = rundir.status(run_dir) if run_dir.is_dir() else None
    if exists and ckpt is None and status in (rundir.RUNNING, rundir.INTERRUPTED) and not force:
        who = f" (pid {stale_pid})" if stale_pid else ""
        console.print(f"[yellow]{run_dir} holds a run{who} that stopped before its first checkpoint: starting "
                      "over.[/]")
        return run_dir, None, True
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
        diff = dist.check_resume(rundir.read_info(run_dir), saved, recipe, diff, console)
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


def check_writable(run_dir: Path) -> None:
    """Before any weights load: a run directory delft could not write to is refused now, not after setup."""
    place = run_dir if run_dir.exists() else next(p for p in run_dir.absolute().parents if p.exists())
    if not place.is_dir():
        raise UserError(f"{place} is a file, so {run_dir} cannot be made inside it", "output.dir",
                        "Choose an output.dir whose parent is a directory.")
    if not os.access(place, os.W_OK | os.X_OK):
        raise UserError(f"{place} is not writable, so the run cannot be saved in {run_dir}", "output.dir",
                        "Choose an output.dir in a directory you can write to.")


# ----------------------------------------------------------------------------- schedule of batches


@dataclass
class Schedule:
    """How the training set becomes optimizer steps: micro-batches per epoch, steps, warmup steps."""

    micro_per_epoch: int
    total_steps: int
    warmup_steps: int


def make_schedule(recipe: Recipe, n_train: int, world_size: int = 1) -> Schedule:
    t = recipe.train
    micro = math.ceil(n_train / t.batch_size)
    total = t.max_steps or max(1, math.ceil(t.epochs * micro / (t.grad_accum * world_size)))
    return Schedule(micro, total, int(round(t.warmup_ratio * total)))


def micro_batch_items(train, recipe: Recipe, schedule: Schedule, index: int):
    """The index-th micro-batch of the endless, per-epoch shuffled stream (deterministic for resume)."""
    epoch, k = divmod(index, schedule.micro_per_epoch)
    order = list(range(len(train)))
    random.Random(recipe.train.seed * 7919 + epoch).shuffle(order)
    bs = recipe.train.batch_size
    return [train[i] for i in order[k * bs:(k + 1) * bs]]


# ----------------------------------------------------------------------------- one optimizer step


def targets(batch: dict):
    """The labels aligned with the decoder's hidden states: position t predicts token t + 1."""
    return batch["labels"][:, 1:]


def forward_sums(model, batch: dict, loss):
    """Hidden states from the decoder, then ``loss.sums`` (CE and digit-term sums, see delft.losses)."""
    from delft.models import decoder_and_head

    decoder, head = decoder_and_head(model)
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    hidden = decoder(input_ids=batch["input_ids"], use_cache=False, **kwargs).last_hidden_state
    return loss.sums(hidden[:, :-1], head, targets(batch))


def optimizer_step(model, batches: list[dict], loss, device: str) -> dict:
    """Backward over the micro-batches, normalised by the whole optimizer batch's counts; returns the step's
    loss, CE and term (``Loss.means``), its real tokens and digit labels."""
    from delft.losses import Counts, Sums

    counts = dist.all_reduce_counts(sum((loss.count(targets(b)) for b in batches), Counts(0, 0)))
    total = Sums(0.0, 0.0, Counts(0, 0))
    for b in batches:
        sums = forward_sums(model, {k: v.to(device) for k, v in b.items()}, loss)
        loss.combine(sums, counts).backward()
        total = total + sums.detach()
    tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in batches)
    total, tokens = dist.global_sums(total, tokens)  # all ranks' batches (one process: unchanged)
    return {**loss.means(total, counts), "tokens": tokens, "n_digits": counts.digits}


def evaluate_loss(model, val, loss, batch_size: int, pad_id: int, device: str) -> dict:
    """Validation loss, CE and term, each normalised over the whole validation set."""
    import torch

    from delft.data import collate
    from delft.losses import Counts, Sums

    model.eval()
    total = Sums(0.0, 0.0, Counts(0, 0))
    with torch.no_grad():
        for i in range(0, len(val), batch_size):
            b = {k: v.to(device) for k, v in collate(val[i:i + batch_size], pad_id).items()}
            total = total + forward_sums(model, b, loss).detach()
    model.train()
    m = loss.means(total, total.counts)
    return {"val_ce": m["ce"], "val_term": m["term"], "val_loss": m["loss"]}


# ----------------------------------------------------------------------------- checkpoints


def rng_states() -> dict:
    import torch

    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def adapter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def check_free_space(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"only {free / 2**20:,.0f} MiB are free in {where}, and the {what} needs about "
                        f"{need / 2**20:,.0f} MiB", "output.dir",
                        "Free some space (the last checkpoint is kept) and run the same command again to resume.")


@contextmanager
def no_space_is_a_user_error(tmp: Path, what: str):
    """A full disk while writing: remove the partial temporary folder and say so, instead of a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"the disk filled up while writing the {what} in {tmp.parent}", "output.dir",
                        "Free some space and run the same command again; the last checkpoint is kept.") from None


def save_checkpoint(run_dir: Path, model, optimizer, scheduler, step: int, keep: int,
                    rng: Optional[dict] = None) -> Path:
    """Adapter + optimizer + scheduler + RNG (``rng``: the states to resume with; default the current ones),
    written to a temporary folder and renamed: never half-written."""
    import torch

    final = rundir.checkpoint_path(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    check_free_space(root, 3 * adapter_bytes(model) + 2**20, "checkpoint")  # weights and Adam's two moments
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng or rng_states()}
    with no_space_is_a_user_error(tmp, "checkpoint"):
        model.save_pretrained(tmp)
        torch.save(state, tmp / rundir.STATE_FILE)
    rundir.follow_umask(tmp)
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


def _truncate_metrics(path: Path, step: int, console: Console) -> None:
    """On resume, forget log lines written after the checkpoint (they will be written again); a last line
    half-written by a killed run is dropped, and said so."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, ln in enumerate(lines):
        try:
            rows.append((ln, json.loads(ln)))
        except ValueError:
            if i < len(lines) - 1:
                raise UserError(f"{path} line {i + 1} is not JSON", "output.dir",
                                "Fix or delete that line (it is a log; the checkpoint holds the state).") from None
            console.print(f"[yellow]{path.name}: dropped a half-written last line (the run was stopped while "
                          "writing it)[/]")
    keep = [ln for ln, row in rows if isinstance(row, dict) and row.get("step", 0) <= step]
    write_atomic(path, "".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------- reporting


def peak_memory_gb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def loss_axis_limits(values: list[float]) -> tuple[float, float]:
    """The y range that shows the curve: from 0 (or the lowest value) to a little above the 95th percentile, so
    the first steps' high loss does not squeeze the rest into the bottom of the plot."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return 0.0, 1.0
    high = finite[min(len(finite) - 1, int(0.95 * len(finite)))]
    low = min(0.0, finite[0])
    return low, max(high * 1.15, low + 1e-3)


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
    values = [r[k] for r in train for k in ("loss", "ce", "term")] + [r["val_loss"] for r in val]
    ax.set_ylim(*loss_axis_limits(values))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    handles, labels = ax.get_legend_handles_labels()
    accuracy = [r for r in rows if "accuracy" in r]
    if accuracy:  # train.accuracy_steps: held-out exact match on a second axis
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in accuracy], [100 * r["accuracy"] for r in accuracy], "s--", color="black",
                 label="held-out exact match (%)")
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("held-out exact match (%)")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)


# ----------------------------------------------------------------------------- stopping


class StopSignals:
    """While training, SIGINT (Ctrl-C) and SIGTERM both raise KeyboardInterrupt, so either one saves a
    checkpoint and exits; inside ``atomic()`` (committing an optimizer step) the signal waits for its end, so
    a checkpoint never holds half a step. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: Optional[int] = None
        self._deferring, self._pending, self._old = False, False, {}

    def _handle(self, signum, frame):
        if self.received is not None:  # a repeat (torchrun forwards the launcher's signal too) must not cut the save short
            return
        self.received = signum
        if self._deferring:
            self._pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    @contextmanager
    def atomic(self):
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)


# ----------------------------------------------------------------------------- the whole run


@dataclass
class Setup:
    """Everything a run needs, built from the recipe (tokenizer, data and loss before any weights load)."""

    recipe: Recipe
    device: str
    quantization: str
    tokenizer: object
    loss: object  # delft.losses.Loss
    train: list
    val: list
    stats: object
    model_ref: object


def setup(recipe: Recipe) -> Setup:
    from delft.data import build_datasets
    from delft.losses import Loss
    from delft.numtokens import NumberVocab
    from delft.models import load_tokenizer, resolve_device, resolve_model, resolve_quantization

    device = resolve_device(recipe.model.device)
    quant = resolve_quantization(recipe.quantization.mode, device)
    ref = resolve_model(recipe.model.name, recipe.model.revision)
    tokenizer = load_tokenizer(ref.path, recipe.model.revision, recipe.model.trust_remote_code)
    if recipe.loss.type != "ce":  # single digits or number tokens of 1-3 digits (Llama-3); glued digits refused
        vocab = NumberVocab.from_tokenizer(tokenizer, purpose=f"loss.type {recipe.loss.type!r}")
    else:
        try:
            vocab = NumberVocab.from_tokenizer(tokenizer)
        except UserError:
            vocab = None  # CE needs no digit tokens; counts are just not reported
    loss = Loss.from_recipe(recipe, vocab, device, dist.world_size())
    train, val, stats = build_datasets(recipe.data, tokenizer, recipe.train.seed,
                                       set(vocab.ids) if vocab else None)
    return Setup(recipe, device, quant, tokenizer, loss, train, val, stats, ref)


def build_model(s: Setup, console: Console):
    """(model with LoRA, dtype, Liger layer kernels applied: [] or ["rms_norm", "swiglu", "rope"])."""
    import torch

    from delft.loss_types import FUSED_CE
    from delft.models import apply_liger_layers, apply_lora, load_model, resolve_dtype

    r = s.recipe
    dtype = resolve_dtype(r.model.dtype, s.device)
    torch.manual_seed(r.train.seed)  # LoRA's A matrices are random: same seed, same init
    model = load_model(s.model_ref, s.device, dtype, s.quantization, r.quantization.double_quant,
                       r.model.revision, r.model.trust_remote_code)
    kernels = apply_liger_layers(model) if s.loss.fused else []
    if s.loss.fused:
        console.print(f"[bold]kernels[/] Liger {', '.join([FUSED_CE] + kernels)}")
    model = apply_lora(model, r.lora, r.train.gradient_checkpointing, r.quantization.kbit_upcast)
    model.train()  # HF skips gradient checkpointing in eval mode (docs/gpu.md: 25 GiB instead of 8.6)
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
    from delft.loss_types import GLOBAL

    how = ("each a mean over the optimizer batch" if lt.normalisation == GLOBAL else
           f"the reference's scaling: term a mean per micro-batch x {s.recipe.train.grad_accum} micro-batches")
    console.print(f"[bold]loss[/] CE + {term} ({how})")


class Trainer:
    """One run's optimizer, schedule and run directory, and the loop that steps, logs, validates and saves."""

    def __init__(self, s: Setup, model, run_dir: Path, console: Console):
        import torch
        from transformers import get_scheduler

        t = s.recipe.train
        self.s, self.model, self.run_dir, self.console = s, model, run_dir, console
        self.recipe, self.loss = s.recipe, s.loss
        self.schedule = make_schedule(s.recipe, len(s.train), dist.world_size())
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, weight_decay=t.weight_decay)
        self.scheduler = get_scheduler(t.lr_scheduler, self.optimizer, num_warmup_steps=self.schedule.warmup_steps,
                                       num_training_steps=self.schedule.total_steps)
        self.metrics_path = run_dir / rundir.METRICS
        self.term_name = s.recipe.loss.type.upper() if s.recipe.loss.type != "ce" else "digit"
        self.step = 0
        self.stops = StopSignals()
        self.step_rng: Optional[dict] = None  # RNG states at the start of a step under way (None between steps)
        self.heldout = None  # delft.heldout.HeldOut when train.accuracy_steps is set
        if t.accuracy_steps:
            from delft.heldout import HeldOut

            self.heldout = HeldOut.from_recipe(s.recipe, s.tokenizer, console)

    # -- run directory

    def open_run_dir(self, ckpt: Optional[Path], replace: bool, kernels: list[str]) -> None:
        """Replace (--force) or resume the run directory, only now that model and data have loaded."""
        from delft.rundir import architecture

        if not dist.is_main():  # reads the checkpoint; rank 0 alone writes the run directory
            self.step = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler) if ckpt else 0
            return
        if replace:
            self.console.print(f"[yellow]--force: replacing {self.run_dir}[/]")
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if ckpt is not None:
            self.step = self.resume_from(ckpt)
            _truncate_metrics(self.metrics_path, self.step, self.console)
            earlier = rundir.read_info(self.run_dir).get("loss_path")  # a resumed run may change paths
            self.loss.ran.update(earlier.split("+") if earlier else ())
        write_atomic(self.run_dir / rundir.RECIPE, dump_recipe(self.recipe))
        s = self.s
        rundir.write_info(self.run_dir, {
            "status": rundir.RUNNING, "base_model": s.model_ref.portable_name(), "base_model_path": s.model_ref.path,
            "architecture": architecture(self.model.get_base_model().config), "quantization": s.quantization,
            "loss": self.recipe.loss.type, "loss_weight": self.recipe.loss.weight, "loss_path": self.loss.path_ran,
            "step": self.step, "total_steps": self.schedule.total_steps, "liger_kernels": kernels,
            "data": asdict(s.stats),
            "world_size": dist.world_size()})

    def resume_from(self, ckpt: Path) -> int:
        """Load ``ckpt``, or the newest older checkpoint that loads when it is damaged (saying so); its step."""
        older = [c for c in reversed(rundir.checkpoints(self.run_dir)) if c.name < ckpt.name]
        for candidate in [ckpt, *older]:
            try:
                return load_checkpoint(candidate, self.model, self.optimizer, self.scheduler)
            except UserError:
                raise
            except Exception as e:  # truncated safetensors, a broken pickle, a missing file: many types
                self.console.print(f"[yellow]checkpoint {candidate} cannot be read ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:120] if str(e) else ''}); trying an older one[/]")
        raise UserError(f"no checkpoint in {rundir.checkpoints_root(self.run_dir)} can be read", "output.dir",
                        "Pass --force to start the run over.")

    def save(self, status: Optional[str] = None) -> Optional[Path]:
        if not dist.is_main():
            return None
        t = self.recipe.train
        path = save_checkpoint(self.run_dir, self.model, self.optimizer, self.scheduler, self.step, t.keep_checkpoints,
                               self.step_rng)
        rundir.update_info(self.run_dir, step=self.step, loss_path=self.loss.path_ran,
                           **({"status": status} if status else {}))
        return path

    # -- steps

    def batch(self, index: int) -> dict:
        from delft.data import collate, collate_packed

        items = micro_batch_items(self.s.train, self.recipe, self.schedule, index)
        pad_id = self.s.tokenizer.pad_token_id
        if self.recipe.data.packing:
            return collate_packed(items, pad_id, self.recipe.data.max_length)
        return collate(items, pad_id)

    def train_step(self) -> tuple[dict, float]:
        """One optimizer step: (Loss.means of it, gradient norm before clipping)."""
        import torch

        t = self.recipe.train
        self.step_rng = rng_states()  # an interrupt before the step commits resumes from exactly here
        batches = [self.batch(i) for i in dist.micro_indices(self.step, t.grad_accum)]
        dist.seed_step(t.seed, self.step)
        out = optimizer_step(self.model, batches, self.loss, self.s.device)
        dist.all_reduce_grads(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
        with self.stops.atomic():
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.step_rng = None
        if not math.isfinite(out["loss"]):
            raise UserError(f"the loss became {out['loss']} at step {self.step}", "train.learning_rate",
                            "Lower train.learning_rate or use dtype float32; the last checkpoint is kept.")
        return out, float(grad_norm)

    def _append_metrics(self, row: dict) -> None:
        if not dist.is_main():
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def log(self, out: dict, grad_norm: float, tokens_per_s: float, stats: str) -> None:
        row = {"step": self.step, "loss": out["loss"], "ce": out["ce"], "term": out["term"],
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "peak_mem_gb": peak_memory_gb(self.s.device), "digit_logit": out.get("digit_logit"),
               "p_digit": out.get("p_digit")}
        self._append_metrics(row)
        self.console.print(f"step {self.step:>5}/{self.schedule.total_steps}  {stats}  lr {row['lr']:.2e}  "
                           f"{tokens_per_s:,.0f} tok/s  peak {row['peak_mem_gb']:.2f} GB", highlight=False)

    def validate(self) -> None:
        if not dist.is_main():  # validation loss runs on rank 0 alone; the others wait at the next step
            return
        ev = evaluate_loss(self.model, self.s.val, self.loss, self.recipe.train.batch_size,
                           self.s.tokenizer.pad_token_id, self.s.device)
        self._append_metrics({"step": self.step, **ev})
        self.console.print(f"step {self.step:>5}  validation loss {ev['val_loss']:.4f}  ce {ev['val_ce']:.4f}  "
                           f"{self.term_name} {ev['val_term']:.4f}", highlight=False)

    def measure_accuracy(self) -> None:
        """Greedy exact match on the held-out slice (delft.heldout), logged and shown; rank 0 alone, like validation."""
        if not dist.is_main():
            return
        row = {"step": self.step, **self.heldout.measure(self.model)}
        self._append_metrics(row)
        self.console.print(f"step {self.step:>5}  held-out exact match {100 * row['accuracy']:.1f} % of "
                           f"{row['accuracy_n']}  (digits {100 * (row['digit_accuracy'] or 0):.1f} %)",
                           highlight=False)

    # -- the loop

    def train(self, resume_command: str) -> None:
        """Step to the end with a live display; Ctrl-C (SIGTERM) saves a checkpoint and exits 130 (143)."""
        import torch
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        t, total = self.recipe.train, self.schedule.total_steps
        self.console.print(f"[bold]training[/] {total} steps x {t.grad_accum} micro-batches of {t.batch_size} "
                           f"{dist.describe()}({self.schedule.micro_per_epoch} micro-batches per epoch), "
                           f"run directory {self.run_dir}")
        if self.s.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        window_tokens, window_start = 0, time.perf_counter()
        with Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=self.console, transient=True) as progress, self.stops:
            task = progress.add_task("train", total=total, completed=self.step, stats="")
            try:
                while self.step < total:
                    out, grad_norm = self.train_step()
                    window_tokens += out["tokens"]
                    rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                    stats = f"loss {out['loss']:.4f}  ce {out['ce']:.4f}  {self.term_name} {out['term']:.4f}"
                    if out.get("p_digit") is not None:  # the shift of the raw digit logits and P(correct digit)
                        stats += f"  digit logit {out['digit_logit']:+.1f}  P(digit) {out['p_digit']:.2f}"
                    progress.update(task, completed=self.step, stats=f"{stats}  {rate:,.0f} tok/s  "
                                                                     f"peak {peak_memory_gb(self.s.device):.2f} GB")
                    last = self.step == total
                    if self.step % t.logging_steps == 0 or last:
                        self.log(out, grad_norm, rate, stats)
                        window_tokens, window_start = 0, time.perf_counter()
                    if self.s.val and (self.step % t.eval_steps == 0 or last):
                        self.validate()
                    if self.heldout is not None and (self.step % t.accuracy_steps == 0 or last):
                        self.measure_accuracy()
                    if self.step % t.save_steps == 0 and not last:
                        self.save()
            except KeyboardInterrupt:
                progress.stop()
                self.save_interrupted(resume_command)

    def save_interrupted(self, resume_command: str) -> None:
        """After Ctrl-C or SIGTERM: a checkpoint of the last whole step (kept when it exists), then exit."""
        path = rundir.checkpoint_path(self.run_dir, self.step)
        if path in rundir.checkpoints(self.run_dir):
            rundir.update_info(self.run_dir, step=self.step, status=rundir.INTERRUPTED, loss_path=self.loss.path_ran)
        else:
            path = self.save(rundir.INTERRUPTED)
        how = "Interrupted" if self.stops.received != signal.SIGTERM else "Stopped (SIGTERM)"
        self.console.print(f"\n[yellow]{how}.[/] Saved {path} (step {self.step}/{self.schedule.total_steps}). "
                           f"Resume with: {resume_command}")
        raise SystemExit(self.stops.exit_code)

    def finish(self) -> None:
        """Adapter and tokenizer at the top of the run directory (PeftModel.from_pretrained(run_dir) loads it)."""
        if not dist.is_main():
            return
        run_dir = self.run_dir
        tmp = run_dir / ".final-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        check_free_space(run_dir, adapter_bytes(self.model) + 2**24, "adapter and tokenizer")
        with no_space_is_a_user_error(tmp, "adapter"):
            self.model.save_pretrained(tmp)
            self.s.tokenizer.save_pretrained(tmp)
        rundir.follow_umask(tmp)
        for f in tmp.iterdir():
            os.replace(f, run_dir / f.name)
        tmp.rmdir()
        if self.metrics_path.is_file():
            plot_losses(self.metrics_path, run_dir / rundir.LOSS_CURVE, self.recipe.loss.type)
        rundir.update_info(run_dir, step=self.step, status=rundir.COMPLETED, loss_path=self.loss.path_ran)
        shutil.rmtree(rundir.checkpoints_root(run_dir), ignore_errors=True)
        self.console.print(f"[bold green]done[/] adapter, tokenizer, metrics.jsonl and loss_curve.png in {run_dir}")


def run_training(recipe: Recipe, resume: Optional[bool] = None, force: bool = False,
                 console: Optional[Console] = None, resume_command: str = "delft train RECIPE.yaml") -> Path:
    """Train ``recipe`` into its output.dir: a fresh run, a resume (``resume`` None: when a checkpoint is there)
    or, with ``force``, a replaced earlier run. Returns the run directory."""
    from delft.runlock import run_lock

    dist.start(recipe.model.device)
    console = dist.rank_console(console or Console())
    check_replaceable(Path(recipe.output.dir))
    check_writable(Path(recipe.output.dir))  # the lock file goes beside the run directory
    with run_lock(Path(recipe.output.dir)) as lock:  # before anything in the directory is read or deleted
        run_dir, ckpt, replace = prepare_run_dir(recipe, resume, force, console, lock.stale_pid)
        random.seed(recipe.train.seed)
        s = setup(recipe)
        model, dtype, kernels = build_model(s, console)
        describe(s, model, dtype, console)
        trainer = Trainer(s, model, run_dir, console)
        dist.barrier("setup")  # every rank has read the run directory before rank 0 replaces or resumes it
        trainer.open_run_dir(ckpt, replace, kernels)
        trainer.train(resume_command)
        trainer.finish()
    return run_dir
