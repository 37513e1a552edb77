import io
import json

import pytest
import torch
from rich.console import Console
from helpers import adapter_weights, interrupt_on_step, recipe_file

import delft.training.sft as train_mod
from delft.errors import UserError
from delft.losses.registry import LOSS_TYPES
from delft.recipe.files import load_recipe
from delft.rundir import latest_checkpoint
from delft.training.stages import run_training


@pytest.mark.slow
def test_loss_falls_and_run_dir_is_complete(tmp_path, tiny_model_dir):
    path = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 30, "eval_steps": 30})
    run = run_training(load_recipe(path))
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses  # from ~4.6 (uniform over 103 tokens)
    assert all(r["term"] > 0 for r in rows if "term" in r)  # the DEL term was computed and logged
    assert any("val_loss" in r for r in rows)
    for name in ("adapter_config.json", "adapter_model.safetensors", "recipe.yaml", "tokenizer.json",
                 "loss_curve.png", "delft_run.json"):
        assert (run / name).is_file(), name
    info = json.loads((run / "delft_run.json").read_text())
    assert info["status"] == "completed" and info["step"] == 30
    assert info["loss_path"] == "chunked_ce" and info["liger_kernels"] == []  # CPU, fused_loss auto: chunked CE
    assert load_recipe(run / "recipe.yaml") == load_recipe(path)


def test_adapter_loads_with_peft_and_changes_the_model(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir)))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(base, str(run)).eval()
        after = tuned(ids).logits
    assert (before - after).abs().max() > 1e-4


def test_interrupt_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir, monkeypatch):
    straight = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, name="straight")))

    path = recipe_file(tmp_path, tiny_model_dir, name="resumed")
    restore = interrupt_on_step(monkeypatch, 5)
    with pytest.raises(SystemExit) as e:
        run_training(load_recipe(path))
    assert e.value.code == 130
    run_dir = tmp_path / "resumed"
    assert latest_checkpoint(run_dir).name == "step-000004"
    assert json.loads((run_dir / "delft_run.json").read_text())["status"] == "interrupted"

    restore()
    run_training(load_recipe(path, ["train.loss_chunk_size=5"]))  # automatic resume; chunking changes no numbers
    a, b = adapter_weights(straight), adapter_weights(run_dir)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(ln)]
    assert steps == [1, 2, 3, 4, 5, 6]  # no duplicated or missing log lines
    assert json.loads((run_dir / "delft_run.json").read_text())["loss_path"] == "chunked_ce"


def test_existing_run_is_never_overwritten_without_force(tmp_path, tiny_model_dir):
    path = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 2})
    run = run_training(load_recipe(path))
    before = adapter_weights(run)
    with pytest.raises(UserError, match="already holds a finished run"):
        run_training(load_recipe(path))
    assert adapter_weights(run).keys() == before.keys()
    run_training(load_recipe(path, ["train.seed=3"]), force=True)
    after = adapter_weights(run)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_force_keeps_the_old_run_when_the_new_one_cannot_start(tmp_path, tiny_model_dir, monkeypatch):
    path = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 2})
    run = run_training(load_recipe(path))
    before = adapter_weights(run)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # fused_loss: on, no CUDA: found after loading the model
    with pytest.raises(UserError, match="fused_loss"):
        run_training(load_recipe(path, ["train.fused_loss=on"]), force=True)
    after = adapter_weights(run)
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((run / "delft_run.json").read_text())["status"] == "completed"


def test_resume_refuses_a_changed_recipe(tmp_path, tiny_model_dir, monkeypatch):
    path = recipe_file(tmp_path, tiny_model_dir)
    monkeypatch.setattr(train_mod, "optimizer_step", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    monkeypatch.undo()
    with pytest.raises(UserError, match="learning_rate"):
        run_training(load_recipe(path, ["train.learning_rate=0.5"]))
    with pytest.raises(UserError, match="already exists"):
        run_training(load_recipe(path), resume=False)


def test_resume_flag_without_checkpoint(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="holds no checkpoint"):
        run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir)), resume=True)


@pytest.mark.parametrize("loss", sorted(LOSS_TYPES))  # every registered type, so a new one is covered too
def test_every_loss_type_trains(tmp_path, tiny_model_dir, loss):
    console = Console(file=io.StringIO(), width=200)
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, loss={"type": loss},
                                               train={"max_steps": 2, "logging_steps": 1})), console=console)
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert json.loads((run / "delft_run.json").read_text())["status"] == "completed"
    no_term = loss == "ce" or LOSS_TYPES[loss].replaces_ce  # dft weighs CE itself
    assert (rows[-1]["term"] == 0) == no_term  # a digit term was computed for every other type
    step_lines = [ln for ln in console.file.getvalue().splitlines() if ln.startswith("step ") and "validation" not in ln]
    assert len(step_lines) == 2, console.file.getvalue()[-2000:]
    # a step line shows a term only where there is one (no "ce 0.0512  DFT 0.0000" for a loss without)
    assert all((f" {loss.upper()} " in ln) != no_term and (" ce " in ln) != no_term for ln in step_lines), step_lines


def test_packing_and_accumulation_train(tmp_path, tiny_model_dir):
    run = run_training(load_recipe(recipe_file(tmp_path, tiny_model_dir, data={"packing": True, "max_length": 128},
                                               train={"max_steps": 2, "grad_accum": 2})))
    assert json.loads((run / "delft_run.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_real_nf4_qlora_trains_on_cpu(tmp_path):
    """Real bitsandbytes nf4 (its CPU backend): 4-bit base layers, LoRA on top, loss finite, adapter saved."""
    from tiny import save_tiny

    model_dir = save_tiny(tmp_path / "wide", hidden=64)
    path = recipe_file(tmp_path, model_dir, quantization={"mode": "nf4"}, train={"max_steps": 2})
    run = run_training(load_recipe(path))
    info = json.loads((run / "delft_run.json").read_text())
    assert info["quantization"] == "nf4" and info["status"] == "completed"
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_nf4_on_cpu_refuses_widths_bitsandbytes_decodes_wrongly(tmp_path, tiny_model_dir):
    path = recipe_file(tmp_path, tiny_model_dir, quantization={"mode": "nf4"})
    with pytest.raises(UserError, match="multiples of 64"):
        run_training(load_recipe(path))


@pytest.mark.parametrize("target", ["", ".", "data", "HERE", "PARENT"])
def test_force_replaces_only_a_run_directory(tmp_path, tiny_model_dir, monkeypatch, target):
    """--force with output.dir empty, '.', the cwd, its parent or a non-run directory deletes nothing."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "keep.txt").write_text("user data")
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    out = {"HERE": str(work), "PARENT": str(tmp_path)}.get(target, target)
    path = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 1})
    with pytest.raises(UserError, match="output.dir"):
        run_training(load_recipe(path, [f"output.dir={out}"]), force=True)
    assert (work / "data" / "keep.txt").read_text() == "user data"
    assert (work / "notes.txt").read_text() == "mine"
    assert (tmp_path / "run.yaml").is_file()


def test_output_dir_that_is_a_file_is_refused(tmp_path, tiny_model_dir):
    f = tmp_path / "afile"
    f.write_text("x")
    path = recipe_file(tmp_path, tiny_model_dir, train={"max_steps": 1})
    with pytest.raises(UserError, match="not a directory"):
        run_training(load_recipe(path, [f"output.dir={f}"]), force=True)
    assert f.read_text() == "x"
