"""What ``delft train`` checks before any weights load, and ``delft recipe check`` checks the same way (one function
both call): the device is there, nf4 or an 8-bit optimizer on the CPU has a bitsandbytes delft has tested there,
every tracker of train.report_to imports, a local data file gives examples. Each costs seconds at most; the same
refusal after the model loaded costs minutes, and a "valid recipe" that train then refuses costs the user's trust in
the check.

And a note at train start when the CPU is oversubscribed: torch's threads wait on each other when other jobs hold
the cores, and one thread a process is then often many times faster.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from delft.data.sources import is_data_file
from delft.data.pipeline import check_not_all_empty, load_examples
from delft.models.context import check_max_length
from delft.models.loading import (
    BNB_CPU_FLOOR,
    EIGHT_BIT_OPTIMIZERS,
    bitsandbytes_version,
    check_bitsandbytes_cpu,
    check_paged_on_cpu,
    release,
    resolve_device,
)
from delft.recipe.schema import GENERATED
from delft.training.loggers import check_backends


def check_before_loading(recipe) -> None:
    """Refuse (UserError) what train would refuse only after loading the model: the cheap checks, in train's order."""
    t = recipe.train
    if recipe.model.device == "cuda":
        resolve_device(recipe.model.device)  # refuses model.device cuda without a GPU
    check_bitsandbytes_here(recipe)
    check_backends(t.report_to)
    folder = Path(recipe.model.name).expanduser()
    if recipe.model.init != "scratch" and folder.is_dir():  # a hub model's config is read once it is here (setup)
        check_max_length(recipe.data.max_length, folder, recipe.model.name)
    if local_data_file(recipe.data.source, recipe.data.format):
        # an empty, unreadable or malformed file is refused by name and row, a file of empty completions too
        examples = load_examples(recipe.data)
        if t.stage == "sft":
            check_not_all_empty(examples, recipe.data)


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
        check_paged_on_cpu(t.optimizer)
        check_bitsandbytes_cpu(f"train.optimizer {t.optimizer}", "train.optimizer")
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


def note_busy_machine(device_pref: str, console) -> None:
    """Print busy_machine's note at train start on the CPU (nothing on a GPU run or where there is no load)."""
    import torch

    if not hasattr(os, "getloadavg") or resolve_device(device_pref) != "cpu":
        return
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this system
        return
    note = busy_machine(load, os.cpu_count() or 1, torch.get_num_threads())
    if note:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
