"""Experiment tracking (train.report_to): every row delft writes to metrics.jsonl also goes to TensorBoard
(torch.utils.tensorboard), Weights & Biases or MLflow, with the resolved recipe as the run's config and the loss
plot at the end. metrics.jsonl stays the source of truth; these are copies for the tools people already watch.

Nothing leaves the machine unless the user says so: wandb runs in offline mode unless WANDB_MODE is set (``wandb
sync`` uploads later), and MLflow writes to the run directory (mlruns/) unless MLFLOW_TRACKING_URI names a server.
Each backend is an extra (tensorboard, wandb, mlflow); a missing one is refused before the first step.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Optional

from delft.errors import UserError
from delft.recipe.keys import flat_keys

BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}  # name -> (module, pip package)
IMPORTS = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # what Reporters imports
TENSORBOARD_DIR, MLFLOW_DIR = "tensorboard", "mlruns"  # in the run directory


def check_backends(names: list[str]) -> None:
    """Refuse a backend whose package is missing or fails to import (a protobuf clash, a broken install), before
    the model loads: found only when the run starts, it would end in a traceback with the run directory begun."""
    for name in names:
        module, package = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"train.report_to lists {name}, but {package} is not installed", "train.report_to",
                            f"pip install \"delft-digits[{name}]\" (or {package}), or drop {name} from "
                            "train.report_to.")
        try:
            importlib.import_module(IMPORTS[name])
        except Exception as e:  # anything a package's import raises: ImportError, protobuf's TypeError, ...
            why = (str(e).strip().splitlines() or [""])[0][:200]
            raise UserError(f"train.report_to lists {name}, but {package} is installed and fails to import "
                            f"({type(e).__name__}: {why})", "train.report_to",
                            f"Repair it (pip install --force-reinstall {package}; `pip check` names a clashing "
                            f"package such as protobuf), or drop {name} from train.report_to.") from None


def _scalars(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and
            not isinstance(v, bool)}


class Reporters:
    """The recipe's tracking backends for one run (rank 0 only)."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, name: str):
        self.names, self.run_dir = list(names), Path(run_dir)
        self.tb = self.wandb = self.mlflow = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
            self.tb.add_text("recipe", "```yaml\n" + _yaml(config) + "\n```")
        if "wandb" in names:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")  # online only when the user asks for it
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "delft"), name=name, config=config,
                                    dir=str(self.run_dir), reinit="finish_previous")
        if "mlflow" in names:
            import mlflow

            if not os.environ.get("MLFLOW_TRACKING_URI"):
                # a file store in the run directory: no server, no database package (mlflow-skinny has none);
                # MLflow 3 keeps it in maintenance mode and asks for this opt-in to write one
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                mlflow.set_tracking_uri((self.run_dir / MLFLOW_DIR).resolve().as_uri())
            self.mlflow = mlflow
            mlflow.start_run(run_name=name)
            mlflow.log_params({k: str(v)[:500] for k, v in flat_keys(config).items()})

    def log(self, row: dict) -> None:
        step, values = int(row["step"]), _scalars(row)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(values, step=step)

    def close(self, plot: Optional[Path] = None) -> None:
        """Flush, attach the loss plot, end the runs."""
        has_plot = plot is not None and Path(plot).is_file()
        if self.tb is not None:
            if has_plot:
                import numpy as np
                from matplotlib import image

                self.tb.add_image("loss_curve", np.asarray(image.imread(str(plot)))[..., :3], dataformats="HWC")
            self.tb.close()
        if self.wandb is not None:
            if has_plot:
                import wandb

                self.wandb.log({"loss_curve": wandb.Image(str(plot))})
            self.wandb.finish()
        if self.mlflow is not None:
            if has_plot:
                self.mlflow.log_artifact(str(plot))
            self.mlflow.end_run()


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
