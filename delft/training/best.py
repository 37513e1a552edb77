"""Early stopping and the best checkpoint (train.early_stopping, train.keep_best): the tracked metric after
every validation (val_loss, lower is better) or held-out measurement (heldout_accuracy, higher is better), the
best step so far, and how many measurements in a row have not improved on it by min_delta. Its state goes into
every checkpoint, so a resumed run stops where the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

LOWER_IS_BETTER = {"val_loss": True, "heldout_accuracy": False}
BEST_DIR = "best"  # in the run directory while training: the model (or adapter) of the best step so far
BEST_INFO = "delft_best.json"  # in BEST_DIR: its step, metric and value


@dataclass
class Tracker:
    metric: str
    min_delta: float = 0.0
    patience: Optional[int] = None  # None: keep_best without early stopping
    best: Optional[float] = None
    best_step: Optional[int] = None
    bad: int = 0  # measurements since the best without an improvement
    measured: int = 0

    @classmethod
    def from_recipe(cls, recipe) -> Optional["Tracker"]:
        t = recipe.train
        if t.early_stopping is None and not t.keep_best:
            return None
        es = t.early_stopping
        return cls(metric=es.metric if es else "val_loss", min_delta=es.min_delta if es else 0.0,
                   patience=es.patience if es else None)

    def update(self, value: float, step: int) -> bool:
        """Take one measurement; True when it is the new best."""
        self.measured += 1
        lower = LOWER_IS_BETTER[self.metric]
        better = self.best is None or (value < self.best - self.min_delta if lower else value > self.best + self.min_delta)
        if better:
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad >= self.patience

    def state(self) -> dict:
        return asdict(self)

    def load(self, state: Optional[dict]) -> None:
        known = {f.name for f in fields(self)}  # a checkpoint is someone's file: it sets only this class's fields
        for k, v in (state or {}).items():
            if k in known:
                setattr(self, k, v)

    def summary(self, stopped_at: Optional[int]) -> dict:
        """What delft_run.json says: the best step and why, and where (and why) training stopped early."""
        how = "lowest" if LOWER_IS_BETTER[self.metric] else "highest"
        out = {"best": {"step": self.best_step, "metric": self.metric, "value": self.best,
                        "why": f"the {how} {self.metric} of {self.measured} measurements (min_delta {self.min_delta:g})"}}
        if stopped_at is not None:
            out["stopped_early"] = {"step": stopped_at, "why": f"{self.metric} did not improve on step "
                                    f"{self.best_step}'s {self.best:.6g} by more than {self.min_delta:g} for "
                                    f"{self.patience} measurements in a row"}
        return out
