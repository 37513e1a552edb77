"""train.report_to: a tiny run logged to TensorBoard, wandb (offline) and MLflow (a file store in the run
directory), each read back with the tool's own reader: the same scalars as metrics.jsonl, the recipe as config."""

import json

import pytest
from helpers import recipe_file, run_cli

from delft.recipe.files import load_recipe
from delft.training.stages import run_training

TRAIN = {"max_steps": 4, "logging_steps": 1, "eval_steps": 2}


def metrics(run) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_gets_every_scalar_of_metrics_jsonl(tmp_path, tiny_model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={**TRAIN,
                                                                                "report_to": ["tensorboard"]})))
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    rows = metrics(run)
    assert {"loss", "ce", "term", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ce"} <= tags
    losses = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows if "loss" in r]
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 4]
    assert "loss_curve" in acc.Tags()["images"] and "recipe/text_summary" in acc.Tags()["tensors"]


def test_wandb_offline_and_mlflow_file_store(tmp_path, tiny_model_dir, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, train={**TRAIN,
                                                                                "report_to": ["wandb", "mlflow"]})))
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1  # offline: nothing left the machine (`wandb sync` would upload it)
    (log,) = offline[0].glob("*.wandb")  # wandb's own record log (protobuf): the keys appear in it as text
    data = log.read_bytes()
    for key in (b"val_loss", b"tokens_per_s", b"finetuning", b"learning_rate"):
        assert key in data, key
    assert list((offline[0] / "files" / "media" / "images").glob("loss_curve_*.png"))
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())  # the file store delft opted into
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(mlrun.info.run_id, "loss")
    rows = metrics(run)
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in rows if "loss" in r]
    assert mlrun.data.params["train.learning_rate"] == "0.01"
    assert [a.path for a in client.list_artifacts(mlrun.info.run_id)] == ["loss_curve.png"]


def test_a_missing_backend_is_refused_before_training(tmp_path, tiny_model_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    res = run_cli("train", recipe_file(tmp_path, tiny_model_dir, train={"report_to": ["wandb"]}))
    assert res.exit_code == 2 and 'pip install "delft-digits[wandb]"' in res.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
