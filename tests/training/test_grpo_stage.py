"""delft train with train.stage grpo on a tiny random-init model: the run directory contract (files, metrics,
eval on the result, the run info's keys as SFT writes them, the last step logged), exact resume after SIGTERM,
continuing an SFT adapter, and refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
from helpers import REPO, recipe_file
from rich.console import Console

from delft.errors import UserError
from delft.recipe.files import load_recipe
from delft.training.stages import run_training

pytest.importorskip("trl")

GRPO = {"num_generations": 2, "max_completion_length": 4, "reward": "partial", "aux_mu": 0.5, "aux_mu_end": 0.1,
        "reward_functions": ["helpers:varied_reward"]}
TRAIN = {"stage": "grpo", "max_steps": 4, "batch_size": 2, "grad_accum": 2, "save_steps": 2, "logging_steps": 1,
         "learning_rate": 5e-2}


def grpo_recipe(tmp_path, model_dir, name="run", **sections):
    return recipe_file(tmp_path, model_dir, name, train={**TRAIN, **sections.pop("train", {})},
                       grpo={**GRPO, **sections.pop("grpo", {})}, loss={"type": "del_prob", "weight": 0.3},
                       data={"max_length": 48}, **sections)


def adapter(run):
    from safetensors.torch import load_file

    return load_file(run / "adapter_model.safetensors")


@pytest.mark.slow
def test_a_grpo_run_keeps_the_run_directory_contract(tmp_path, tiny_model_dir):
    from delft.evaluation.command import run_eval

    run = run_training(load_recipe(grpo_recipe(tmp_path, tiny_model_dir)), console=Console(quiet=True))
    info = json.loads((run / "delft_run.json").read_text())
    assert info["status"] == "completed" and info["stage"] == "grpo" and info["step"] == 4
    assert (run / "recipe.yaml").is_file() and (run / "loss_curve.png").is_file()
    assert not (run / "checkpoints").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # rewards, advantages and the auxiliary term, per step
        assert {"reward", "reward_std", "reward_exact", "reward_digits", "reward_varied_reward", "advantage_abs",
                "ce", "term", "mu", "tokens_per_s"} <= set(r)
        assert r["advantage_abs"] >= 0 and r["ce"] > 0 and r["reward_varied_reward"] > 0
    assert any(r["advantage_abs"] > 0 for r in rows)  # rewards varied within a group somewhere
    assert rows[0]["mu"] == pytest.approx(0.5) and rows[-1]["mu"] == pytest.approx(0.1)  # decayed over the run
    results = run_eval(runs=[str(run)], model=str(tiny_model_dir), data="synthetic", limit=3, include_base=False,
                       overrides=["eval.max_new_tokens=4", "eval.bootstrap=10"], console=Console(quiet=True))
    assert results[0].metrics["n"] == 3  # delft eval takes a GRPO run as it takes an SFT run


@pytest.fixture(scope="module")
def both_stages(tmp_path_factory, tiny_model_dir):
    """A finished SFT run and a finished GRPO run of the same model and data: 2 steps, logging_steps 5."""
    root = tmp_path_factory.mktemp("stages")
    short = {"max_steps": 2, "logging_steps": 5}
    sft = run_training(load_recipe(recipe_file(root, tiny_model_dir, "sft", train=short)), console=Console(quiet=True))
    grpo = run_training(load_recipe(grpo_recipe(root, tiny_model_dir, "grpo", train=short)), console=Console(quiet=True))
    return sft, grpo


@pytest.mark.slow
def test_both_stages_write_the_same_run_info_keys(both_stages):
    sft, grpo = (json.loads((run / "delft_run.json").read_text()) for run in both_stages)
    assert sft.keys() == grpo.keys(), set(sft) ^ set(grpo)
    assert (sft["stage"], grpo["stage"]) == ("sft", "grpo")
    assert sft["status"] == grpo["status"] == "completed" and sft["step"] == grpo["step"] == 2
    assert sft["architecture"] == grpo["architecture"] and sft["base_model"] == grpo["base_model"]


@pytest.mark.slow
def test_a_run_logs_its_last_step_when_max_steps_is_not_a_multiple_of_logging_steps(both_stages):
    for run in both_stages:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [2], run.name
    assert (both_stages[1] / "loss_curve.png").is_file()


def sigterm_after(step: int, monkeypatch):
    """SIGTERM to this process at the end of optimizer step ``step`` (the run then saves it and exits 143);
    returns the undo."""
    from delft.training import grpo

    original = grpo.RunDirCallback.on_step_end

    def stop(self, args, state, control, **kwargs):
        if state.global_step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, args, state, control, **kwargs)

    monkeypatch.setattr(grpo.RunDirCallback, "on_step_end", stop)
    return lambda: monkeypatch.setattr(grpo.RunDirCallback, "on_step_end", original)


@pytest.mark.slow
def test_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, monkeypatch):
    import torch

    straight = run_training(load_recipe(grpo_recipe(tmp_path, tiny_model_dir, "straight")), console=Console(quiet=True))
    path = grpo_recipe(tmp_path, tiny_model_dir, "cut")
    undo = sigterm_after(2, monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        run_training(load_recipe(path), console=Console(quiet=True))
    assert stopped.value.code == 143
    cut = tmp_path / "cut"
    assert json.loads((cut / "delft_run.json").read_text())["status"] == "interrupted"
    assert (cut / "checkpoints" / "step-000002").is_dir()
    undo()
    run_training(load_recipe(path), console=Console(quiet=True))  # resumes from step 2
    a, b = adapter(straight), adapter(cut)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


@pytest.mark.slow
def test_grpo_continues_an_sft_adapter(tmp_path, tiny_model_dir):
    import torch

    sft = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, "sft", train={"max_steps": 2},
                                               lora={"r": 4, "alpha": 8})), console=Console(quiet=True))
    path = grpo_recipe(tmp_path, tiny_model_dir, "rl", model={"name": str(tiny_model_dir), "adapter": str(sft)},
                       train={"learning_rate": 1e-12, "max_steps": 1})
    rl = run_training(load_recipe(path), console=Console(quiet=True))
    before, after = adapter(sft), adapter(rl)
    assert before.keys() == after.keys()  # the same LoRA (r=4), continued: not a new one from the lora section
    assert all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)
    assert json.loads((rl / "delft_run.json").read_text())["continued_from"] == str(sft)


def test_grpo_refusals(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="cannot import 'nowhere:nothing'"):
        run_training(load_recipe(grpo_recipe(tmp_path, tiny_model_dir, "a",
                                             grpo={"reward_functions": ["nowhere:nothing"]})), console=Console(quiet=True))
    merged = tmp_path / "merged"
    shutil.copytree(tiny_model_dir, merged)  # a whole model (config and weights), not an adapter
    with pytest.raises(UserError, match="holds a merged model, not a LoRA adapter"):
        run_training(load_recipe(grpo_recipe(tmp_path, tiny_model_dir, "b",
                                             model={"name": str(tiny_model_dir), "adapter": str(merged)})),
                     console=Console(quiet=True))


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_grpo_three_steps_log_and_resume_exactly(tmp_path, monkeypatch):
    """The real SmolLM2-135M, three GRPO steps on the CPU with the partial reward and the auxiliary CE + DEL term:
    rewards, advantages and the term are logged every step, and SIGTERM after step 2 + resume gives the
    uninterrupted run's adapter."""
    import torch

    def recipe(name):
        return load_recipe(REPO / "recipes" / "grpo" / "arithmetic.yaml", [
            "model.adapter=null", "train.max_steps=3", "train.save_steps=2", "train.batch_size=2",
            "grpo.num_generations=2", "grpo.max_completion_length=8", "train.learning_rate=1e-4",
            "grpo.aux_mu=0.3", f"output.dir={tmp_path / name}", "model.device=cpu"])

    straight = run_training(recipe("straight"), console=Console(quiet=True))
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["reward"] is not None and r["advantage_abs"] is not None and r["ce"] > 0 and r["term"] > 0
    undo = sigterm_after(2, monkeypatch)
    with pytest.raises(SystemExit):
        run_training(recipe("cut"), console=Console(quiet=True))
    undo()
    cut = run_training(recipe("cut"), console=Console(quiet=True))
    a, b = adapter(straight), adapter(cut)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


class Planted:
    """Unpickling this runs ``touch SENTINEL``: an object planted in a shared GRPO run's checkpoint."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@pytest.mark.slow
def test_a_pickled_object_in_a_trainer_checkpoint_is_refused_before_transformers_reads_it(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    """transformers' Trainer itself loads with weights_only=True; delft reads first, so the refusal is its own
    paragraph (exit 2) and the run is left as it was."""
    import torch
    from transformers.trainer_pt_utils import safe_globals

    path = grpo_recipe(tmp_path, tiny_model_dir, "shared")
    sigterm_after(2, monkeypatch)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path), console=Console(quiet=True))
    monkeypatch.undo()
    rng_file = tmp_path / "shared" / "checkpoints" / "step-000002" / "rng_state.pth"
    with safe_globals():  # numpy's RNG state, as transformers reads it
        state = torch.load(rng_file, weights_only=True)
    sentinel = tmp_path / "code-ran"
    state["planted"] = Planted(sentinel)
    torch.save(state, rng_file)
    files = {p: p.read_bytes() for p in (tmp_path / "shared").rglob("*") if p.is_file()}
    with pytest.raises(UserError, match="holds Python objects") as refused:
        run_training(load_recipe(path), console=Console(quiet=True))
    assert "rng_state.pth" in str(refused.value) and not sentinel.exists()
    assert {p: p.read_bytes() for p in (tmp_path / "shared").rglob("*") if p.is_file()} == files


@pytest.mark.slow
def test_grpo_on_reversed_numbers_reads_every_completion_back(tmp_path, digit_model_path, monkeypatch):
    """TRL's real GRPOTrainer calls delft's rewards on what the model wrote (a tiny model that writes only digits
    and '.'); each text reaches the scorer read back from the run's form (data.numbers reversed)."""
    from delft.data.prompts import read_completion
    from delft.numbers import rewards

    seen: list[str] = []
    extract = rewards.extract_answer
    monkeypatch.setattr(rewards, "extract_answer", lambda text, stops: seen.append(text) or extract(text, stops))
    raw: list[str] = []
    cut = rewards.cut_at_stop
    monkeypatch.setattr(rewards, "cut_at_stop", lambda text, stops: raw.append(text) or cut(text, stops))
    recipe = load_recipe(recipe_file(
        tmp_path, digit_model_path, "run", train={**TRAIN, "max_steps": 2, "save_steps": 10},
        grpo={**GRPO, "reward_functions": []}, loss={"type": "del_prob", "weight": 0.3},
        data={"max_length": 48, "numbers": {"order": "reversed", "scope": "answer"}}))
    run = run_training(recipe, console=Console(quiet=True))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward_exact" in r and "reward_digits" in r for r in rows)
    assert raw and len(seen) == len(raw)  # each reward reads each completion once
    assert seen == [read_completion(cut(t, rewards.PLAIN_STOP_STRINGS), recipe.data) for t in raw]
    assert any(s != t for s, t in zip(seen, raw))  # multi-digit numbers, read back reversed


@pytest.mark.parametrize("loss, shown", [("del", "aux CE 0.5000 DEL 0.1000 mu 0.20"), ("ce", "aux CE 0.5000 mu 0.20"),
                                         ("dft", "aux CE 0.5000 mu 0.20")])
def test_a_grpo_step_line_shows_the_auxiliary_term_only_where_the_loss_has_one(loss, shown):
    """As the SFT loop's lines: no "digit 0.0000" for ce or "DFT 0.0000" for dft, which have no digit term."""
    from types import SimpleNamespace

    from delft.training.grpo import RunDirCallback

    row = {"loss": 0.3, "reward": 0.5, "reward_std": 0.1, "reward_exact": 0.25, "tokens_per_s": 100.0, "ce": 0.5,
           "term": 0.1, "mu": 0.2}
    line = RunDirCallback(None, 1, loss).line(row, SimpleNamespace(global_step=2, max_steps=4))
    assert shown in line, line
    assert (" DEL " in line) == (loss == "del") and " DFT " not in line and " digit " not in line, line
