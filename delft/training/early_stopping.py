"""Early stopping and the best checkpoint (train.early_stopping, train.keep_best): the tracked metric after
every validation (val_loss, lower is better) or held-out measurement (heldout_accuracy, higher is better), the
best step so far (always the lowest, or highest, value measured), and how many measurements in a row have not
improved by more than min_delta on the last one that did. min_delta only decides when to stop: a small improvement
is still the best model, it just does not reset patience. Its state goes into every checkpoint, so a resumed run
stops where the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

LOWER_IS_BETTER = {"val_loss": True, "heldout_accuracy": False}
BEST_DIR = "best"  # in the run directory while training: the model (or adapter) of the best step so far
BEST_INFO = "delft_best.json"  # in BEST_DIR: its step, metric and value


@dataclass
class EarlyStopping:
    metric: str
    min_delta: float = 0.0
    patience: Optional[int] = None  # None: keep_best without early stopping
    best: Optional[float] = None
    best_step: Optional[int] = None
    bad: int = 0  # measurements since `ref` without an improvement by more than min_delta
    measured: int = 0
    ref: Optional[float] = None  # the value patience counts from: the last improvement by more than min_delta
    ref_step: Optional[int] = None

    @classmethod
    def from_recipe(cls, recipe) -> Optional["EarlyStopping"]:
        t = recipe.train
        if t.early_stopping is None and not t.keep_best:
            return None
        es = t.early_stopping
        return cls(metric=es.metric if es else "val_loss", min_delta=es.min_delta if es else 0.0,
                   patience=es.patience if es else None)

    def update(self, value: float, step: int) -> bool:
        """Take one measurement; True when it is the new best (by any margin: min_delta only counts patience)."""
        self.measured += 1
        lower = LOWER_IS_BETTER[self.metric]
        better = self.best is None or (value < self.best if lower else value > self.best)
        if better:
            self.best, self.best_step = value, step
        enough = self.ref is None or (value < self.ref - self.min_delta if lower else value > self.ref + self.min_delta)
        if enough:
            self.ref, self.ref_step, self.bad = value, step, 0
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
        if self.ref is None and self.best is not None:  # a checkpoint from before `ref`: its best counted patience
            self.ref, self.ref_step = self.best, self.best_step

    def summary(self, stopped_at: Optional[int]) -> dict:
        """What delft_run.json says: the best step and why, and where (and why) training stopped early."""
        how = "lowest" if LOWER_IS_BETTER[self.metric] else "highest"
        out = {"best": {"step": self.best_step, "metric": self.metric, "value": self.best,
                        "why": f"the {how} {self.metric} of {self.measured} measurements (min_delta {self.min_delta:g})"}}
        if stopped_at is not None:
            out["stopped_early"] = {"step": stopped_at, "why": f"{self.metric} did not improve on step "
                                    f"{self.ref_step}'s {self.ref:.6g} by more than {self.min_delta:g} for "
                                    f"{self.patience} measurements in a row"}
        return out
