"""What a run reports besides the metrics rows: peak memory and the loss curve plot.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

from delft.losses.registry import LOSS_TYPES
from delft.outputs import staged


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


def loss_stats(loss_type: str, loss: float, ce: float, term: float) -> str:
    """The loss figures of a step or validation line: CE and the digit term beside the loss where the loss has a
    term; the loss alone for ce and dft (dft's loss is its weighted CE), which have no term to show."""
    if LOSS_TYPES[loss_type].has_term:
        return f"loss {loss:.4f}  ce {ce:.4f}  {loss_type.upper()} {term:.4f}"
    return f"loss {loss:.4f}"


def plot_losses(metrics_path: Path, out: Path, loss_type: str) -> None:
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
        if LOSS_TYPES[loss_type].has_term:
            ax.plot([r["step"] for r in train], [r["term"] for r in train], label=f"train {loss_type.upper()} term",
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
    try:
        with staged(out, ".png") as tmp:  # matplotlib picks the format from the suffix
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
