"""Data-parallel training over several processes (torchrun, accelerate launch, ``delft train --nproc N``).

Each rank holds its own copy of the model on its own device. An optimizer batch is ``batch_size x grad_accum x
world_size`` examples: rank r takes micro-batches ``r*grad_accum .. (r+1)*grad_accum - 1`` of every optimizer step's
share of the one shuffled stream, so the ranks' examples are disjoint and together the same as one process with
``grad_accum x world_size`` micro-batches. The label and digit counts are summed over all ranks before the first
backward and the LoRA gradients are summed after the last one, so the gradient is that of one process on the whole
optimizer batch (no DDP wrapper: only the adapter has gradients, and one all-reduce of them is exact and simple).

Randomness: with several processes, each optimizer step re-seeds torch's generators (CPU and CUDA) from
(train.seed, rank, step), so dropout is well defined per rank and a resume needs no saved generator state.
Only rank 0 writes files and shows the display; the others are silent unless they fail.
The launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is all this reads;
DELFT_DIST_TIMEOUT (seconds, default 1800) bounds every collective, so a lost rank never hangs the others.
"""

from __future__ import annotations

import os

from delft.children import on_parent_death
from delft.errors import UserError
from delft.models.loading import resolve_device

TIMEOUT_ENV = "DELFT_DIST_TIMEOUT"


DEFAULT_TIMEOUT_S = 1800  # rank 0 validates alone while the others wait: must outlast a validation pass


def launched() -> bool:
    """Started by a launcher (torchrun / accelerate set WORLD_SIZE), even with a single process."""
    return "WORLD_SIZE" in os.environ


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """The one process that writes files and shows the display."""
    return rank() == 0


def start(device_pref: str) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU) and pin this rank's GPU; nothing for one process."""
    if not launched():
        return
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _die_with_the_launcher()
    device = resolve_device(device_pref)
    if device == "cuda":
        torch.cuda.set_device(local_rank())  # "cuda" (and nf4's device_map) now mean this rank's GPU
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    dist.init_process_group(backend(device), timeout=timeout)
    import atexit

    atexit.register(stop)
    _interrupt_once()


BACKEND_ENV = "DELFT_DIST_BACKEND"  # nccl or gloo; unset: nccl on CUDA, gloo on the CPU


def backend(device: str) -> str:
    """The process group's backend: DELFT_DIST_BACKEND when set (refused where it cannot run), else nccl on CUDA
    and gloo on the CPU."""
    import torch.distributed as dist

    asked = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not asked:
        return "nccl" if device == "cuda" else "gloo"
    if asked not in ("nccl", "gloo"):
        raise UserError(f"{BACKEND_ENV}={asked!r} names no backend delft uses", BACKEND_ENV,
                        "Set it to nccl (GPUs) or gloo (CPU, or GPUs without NCCL), or unset it.")
    if asked == "nccl" and (device != "cuda" or not dist.is_nccl_available()):
        why = "this run trains on the CPU" if device != "cuda" else "this torch was built without NCCL"
        raise UserError(f"{BACKEND_ENV}=nccl asks for NVIDIA's collectives, and {why}", BACKEND_ENV,
                        "Unset it (gloo is used on the CPU), or run on CUDA GPUs with a torch built with NCCL.")
    return asked


def _die_with_the_launcher() -> None:
    """On Linux, have the kernel kill this worker when its parent (the launcher's agent) dies, even by SIGKILL,
    so a killed launcher never leaves workers training on. The last checkpoint is intact (written whole)."""
    import signal

    if not on_parent_death(signal.SIGKILL):
        return
    if os.getppid() == 1:  # the launcher died before the request took effect
        os._exit(1)


def _interrupt_once() -> None:
    """Ctrl-C reaches a worker twice (from the terminal, then forwarded by torchrun): the first raises
    KeyboardInterrupt, so rank 0 saves a checkpoint; a repeat must not cut that save short."""
    import signal

    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def stop() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def describe() -> str:
    """' on N processes ' for the training line; '' for one process."""
    return f"on {world_size()} processes " if world_size() > 1 else ""


def rank_console(console):
    """The console itself on rank 0; a silent one elsewhere (errors still reach stderr through the CLI)."""
    if is_main():
        return console
    from rich.console import Console

    return Console(quiet=True)


def micro_indices(step: int, grad_accum: int) -> list[int]:
    """This rank's micro-batch indices (into the endless stream) for optimizer step ``step``."""
    first = (step * world_size() + rank()) * grad_accum
    return list(range(first, first + grad_accum))


def seed_step(seed: int, step: int) -> None:
    """Re-seed torch's generators for this rank and step (several processes only; see the module docstring)."""
    if not launched():
        return
    import torch

    # also seeds every CUDA device; modulo torch's 64-bit range, which train.seed up to 2**32 - 1 would pass
    torch.manual_seed(((seed * 1_000_003 + rank()) * 1_000_003 + step) % 2**64)


def _collective(what: str, fn, *args):
    """Run a collective; a peer that died or stopped answering becomes one paragraph naming this rank."""
    try:
        return fn(*args)
    except RuntimeError as e:  # gloo / nccl report a lost peer or a timeout as RuntimeError subclasses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"rank {rank()} of {world_size()} lost the other ranks during {what} ({first[:200]}): "
                        "another rank died or stopped; the launcher's summary names it", "the launch",
                        "Fix what stopped that rank, then run the same command again: it resumes from the last "
                        "checkpoint, which is intact.") from None


def all_reduce_counts(counts):
    """The optimizer batch's label and digit counts summed over all ranks (delft.losses.loss.Counts)."""
    if world_size() == 1:
        return counts
    import torch
    import torch.distributed as dist

    t = torch.tensor([counts.labels, counts.digits], dtype=torch.int64, device=_device())
    _collective("the count all-reduce", dist.all_reduce, t)
    return type(counts)(int(t[0]), int(t[1]))


def all_reduce_floats(values: list[float]) -> list[float]:
    """Floats summed over all ranks, in float64 (logged loss sums, token counts)."""
    if world_size() == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_device())
    _collective("the statistics all-reduce", dist.all_reduce, t)
    return t.tolist()


def all_reduce_grads(params) -> None:
    """Sum the trainable gradients over all ranks, as one flat buffer (the loss is already globally normalised)."""
    if world_size() == 1:
        return
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    _collective("the gradient all-reduce", dist.all_reduce, flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()


def barrier(what: str) -> None:
    if world_size() == 1:
        return
    import torch.distributed as dist

    _collective(what, dist.barrier)


def _device():
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"


def global_sums(sums, tokens: int):
    """(this step's delft.losses.loss.Sums added over all ranks, tokens over all ranks): what the log and tok/s
    report. The whole object goes in one all-reduce (``Sums.as_floats``), so no field is dropped."""
    if world_size() == 1:
        return sums, tokens
    *values, tok = all_reduce_floats([*sums.as_floats(), float(tokens)])
    return type(sums).from_floats(values), int(tok)
