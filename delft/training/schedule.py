"""Which examples each optimizer step sees: the step count of a run and its micro-batches from one seeded,
endless stream shared by every rank.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from delft.errors import UserError
from delft.recipe.schema import Recipe


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


def check_snapshot_steps(recipe: Recipe, total_steps: int) -> None:
    """Refuse snapshot steps after the run's last step, which would never be taken: with train.epochs the total
    is known only once the data is read (the recipe's schema refuses them against train.max_steps)."""
    late = [s for s in recipe.train.snapshot_steps if s > total_steps]
    if late:
        raise UserError(f"snapshot_steps {late[:5]} come after the run's last step: train.epochs "
                        f"{recipe.train.epochs:g} over this data is {total_steps} steps, so they would never be taken",
                        "train.snapshot_steps", f"Give steps of at most {total_steps}, or set train.max_steps.")


def micro_batch_items(train, recipe: Recipe, schedule: Schedule, index: int):
    """The index-th micro-batch of the endless, per-epoch shuffled stream (deterministic for resume)."""
    epoch, k = divmod(index, schedule.micro_per_epoch)
    order = list(range(len(train)))
    random.Random(recipe.train.seed * 7919 + epoch).shuffle(order)
    bs = recipe.train.batch_size
    return [train[i] for i in order[k * bs:(k + 1) * bs]]
