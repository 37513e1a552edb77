"""What ``delft train`` checks before any weights load, and ``delft recipe check`` checks the same way (one function
both call): the device is there, nf4 or an 8-bit optimizer on the CPU has a bitsandbytes delft has tested there,
every tracker of train.report_to imports, a local data file gives examples, the held-out slice of
train.accuracy_steps is not the training data (delft.training.heldout). Each costs seconds at most; the same
refusal after the model loaded costs minutes, and a "valid recipe" that train then refuses costs the user's trust in
the check.

And a note at train start when the CPU is oversubscribed: torch's threads wait on each other when other jobs hold
the cores, and one thread a process is then often many times faster.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Optional

from delft.data.sources import is_data_file
from delft.errors import UserError
from delft.data.pipeline import check_not_all_empty, load_examples
from delft.models.context import check_max_length
from delft.models.loading import (
    BNB_CPU_FLOOR,
    bitsandbytes_version,
    check_bitsandbytes_cpu,
    check_eight_bit_on_cpu,
    release,
    resolve_device,
)
from delft.recipe.schema import GENERATED
from delft.recipe.train_section import EIGHT_BIT_OPTIMIZERS
from delft.training.heldout import check_heldout_slice
from delft.training.loggers import check_backends


def check_before_loading(recipe) -> None:
    """Refuse (UserError) what train would refuse only after loading the model: the cheap checks, in train's order."""
    t = recipe.train
    if recipe.model.device == "cuda":
        resolve_device(recipe.model.device)  # refuses model.device cuda without a GPU
    check_bitsandbytes_here(recipe)
    check_backends(t.report_to)
    if named_folder(recipe):  # here, not in setup: any other model's config is read once it is here (setup)
        check_max_length(recipe.data.max_length, Path(recipe.model.name).expanduser(), recipe.model.name)
    if local_data_file(recipe.data.source, recipe.data.format):
        # an empty, unreadable or malformed file is refused by name and row, a file of empty completions too; the
        # parse is kept for setup and the held-out slice (delft.data.pipeline reads a file once per process)
        examples = load_examples(recipe.data)
        if t.stage == "sft":
            check_not_all_empty(examples, recipe.data)
    check_heldout_slice(recipe)


def named_folder(recipe) -> bool:
    """Whether model.name names a model folder here (not an alias, a GGUF file or a hub id): its context is
    checked here, before loading, and setup does not read it again."""
    return recipe.model.init != "scratch" and Path(recipe.model.name).expanduser().is_dir()


def check_bitsandbytes_here(recipe) -> None:
    """nf4 or an 8-bit AdamW on the CPU: refused below the bitsandbytes delft has tested there, and paged_adamw_8bit
    refused (it runs unpaged). Torch is imported (to resolve model.device auto) only when one of them applies."""
    t = recipe.train
    eight_bit = t.stage == "sft" and t.optimizer in EIGHT_BIT_OPTIMIZERS
    nf4 = recipe.quantization.mode == "nf4"  # auto is never nf4 on the CPU
    if not (eight_bit or nf4) or recipe.model.device == "cuda":
        return
    have = bitsandbytes_version()
    below = have is None or release(have) < release(BNB_CPU_FLOOR)
    if not below and t.optimizer != "paged_adamw_8bit":
        return
    if resolve_device(recipe.model.device) != "cpu":
        return
    if eight_bit:
        check_eight_bit_on_cpu(t.optimizer)
    if nf4:
        check_bitsandbytes_cpu("quantization.mode nf4", "quantization.mode")


def local_data_file(source: str, fmt: str) -> bool:
    """Whether data.source names a file here (as the data loader reads it), not a hub id or a generator."""
    return fmt not in GENERATED and is_data_file(source)


def busy_machine(load: float, cores: int, threads: int) -> Optional[str]:
    """The note when the 1-minute load average is above the cores and torch runs more than one thread, else None."""
    if load <= cores or threads <= 1:
        return None
    return (f"the CPU is busy (load {load:.1f} on {cores} cores) and torch runs {threads} threads a process: they "
            "wait on each other. If steps are slow, run with OMP_NUM_THREADS=1 (or torch.set_num_threads(1) in a "
            "script); see docs/performance.md")


THREADS_ENV = "DELFT_THREADS"


def thread_choice(load: float, cores: int, threads: int, env: dict) -> tuple[Optional[int], Optional[str]]:
    """(threads to set, or None to keep torch's; what to say) for a CPU run: DELFT_THREADS when given; torch's own
    count where OMP_NUM_THREADS is set (the user chose) or the machine is free; one thread on a busy machine (load
    above the cores), where more would wait on each other."""
    raw = env.get(THREADS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise UserError(f"{THREADS_ENV}={raw!r} is not a number of threads", THREADS_ENV,
                            "Give 1 or more, or unset it to let delft choose from the machine's load.")
        return int(raw), f"torch runs {int(raw)} thread{'s' if int(raw) > 1 else ''} a process ({THREADS_ENV})"
    if env.get("OMP_NUM_THREADS") or busy_machine(load, cores, threads) is None:
        return None, None
    return 1, (f"the CPU is busy (load {load:.1f} on {cores} cores), so torch runs 1 thread a process instead of "
               f"{threads}, which would wait on each other (as OMP_NUM_THREADS=1 would). {THREADS_ENV}=N or "
               "OMP_NUM_THREADS=N chooses instead; see docs/performance.md")


@functools.cache
def torch_threads() -> int:
    """torch's own thread count, read once a process, before delft first sets it. A study trains run after run in
    one process: each run chooses from this, not from what the last run set, so one start on a busy machine does not
    leave every later run on one thread."""
    import torch

    return torch.get_num_threads()


# (monotonic seconds, this process's CPU seconds) when it last chose its threads: what its own runs since then added
# to the load average (a study trains run after run in one process)
_LAST_CHOICE: list[tuple[float, float]] = []


def load_of_others(load: float) -> float:
    """The 1-minute load average less this process's own share: the cores its threads kept busy on average since it
    last chose (0 at its first choice). Without this a study's run counted the run before it as someone else's work
    and took one thread on a machine nothing else used."""
    now, cpu = time.monotonic(), time.process_time()  # process_time: every thread of this process
    own = 0.0
    if _LAST_CHOICE and now > _LAST_CHOICE[0][0]:
        own = (cpu - _LAST_CHOICE[0][1]) / (now - _LAST_CHOICE[0][0])
    _LAST_CHOICE[:] = [(now, cpu)]
    return max(0.0, load - own)


def note_busy_machine(device_pref: str, console) -> None:
    """On the CPU, set torch's thread count as ``thread_choice`` says (torch's own where it keeps it) and print why
    (nothing on a GPU run)."""
    import torch

    if resolve_device(device_pref) != "cpu":
        return
    try:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    except OSError:  # no load average on this system
        load = 0.0
    load = load_of_others(load)
    threads, note = thread_choice(load, os.cpu_count() or 1, torch_threads(), dict(os.environ))
    torch.set_num_threads(threads or torch_threads())
    if note:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
