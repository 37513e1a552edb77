"""Sharded training (train.distributed fsdp, delft.training.sharding): real torchrun processes on the CPU (gloo), FSDP2
shards of the tiny model, compared with one unsharded process on the same global batch."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, adapter_weights, free_port, recipe_file, run_cli
from test_distributed import LOGGED, finished, start, torchrun, wait_for

# Two ranks sum their gradient shards in another order than one process accumulates them, and AdamW's first steps
# divide by tiny second moments: the weights agree to float32 rounding of that, not bit for bit.
RTOL, ATOL = 1e-4, 1e-5


def model_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(run_dir.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}


def assert_same_weights(a: dict, b: dict, moved_from: dict = None) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    if moved_from is not None:  # training changed the weights, so equal means equal after real steps
        assert any(not torch.equal(a[k], moved_from[k]) for k in moved_from)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_log(a_dir: Path, b_dir: Path) -> None:
    rows, ref = metrics(a_dir), metrics(b_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for r, q in zip(rows, ref):
        assert set(r) == set(q)
        for key in LOGGED:
            if q.get(key) is not None:
                assert r[key] == pytest.approx(q[key], rel=1e-4, abs=1e-6), (key, r["step"], r[key], q[key])


def full_recipes(tmp_path: Path, model_dir: Path, **train) -> tuple[Path, Path, Path]:
    """(one process x 2 micro-batches, ddp; 2 ranks x 1, fsdp; 2 ranks x 1, ddp) of a full fine-tuning run."""
    common = {"finetuning": "full", "max_steps": 4, "save_steps": 2, "eval_steps": 2, "accuracy_steps": 2,
              "accuracy_examples": 4, "snapshot_steps": [2], "keep_best": True, **train}
    loss = {"type": "del_prob", "weight": 0.5}
    one = recipe_file(tmp_path, model_dir, name="one", loss=loss, train={**common, "grad_accum": 2})
    fsdp = recipe_file(tmp_path, model_dir, name="fsdp", loss=loss,
                       train={**common, "grad_accum": 1, "distributed": "fsdp"})
    ddp = recipe_file(tmp_path, model_dir, name="ddp", loss=loss, train={**common, "grad_accum": 1})
    return one, fsdp, ddp


@pytest.mark.slow
def test_fsdp_full_finetuning_on_two_ranks_equals_one_process_and_ddp(tmp_path, tiny_model_dir):
    from delft.recipe.files import load_recipe
    from delft.rundir import read_info
    from delft.training.stages import run_training

    one, fsdp, ddp = full_recipes(tmp_path, tiny_model_dir)
    out = finished(torchrun(fsdp))
    run_training(load_recipe(one))
    finished(torchrun(ddp))
    start_weights = model_weights(tiny_model_dir)
    assert_same_weights(model_weights(tmp_path / "fsdp"), model_weights(tmp_path / "one"), start_weights)
    assert_same_weights(model_weights(tmp_path / "fsdp"), model_weights(tmp_path / "ddp"))
    assert_same_log(tmp_path / "fsdp", tmp_path / "one")
    # held-out accuracy (every rank generates with the gathered weights), the snapshot and keep_best's choice
    from delft.evaluation.metrics import EXACT_MATCH

    heldout = [r for r in metrics(tmp_path / "fsdp") if EXACT_MATCH.heldout in r]
    assert [r["step"] for r in heldout] == [2, 4]
    assert heldout == [r for r in metrics(tmp_path / "one") if EXACT_MATCH.heldout in r]
    assert_same_weights(model_weights(tmp_path / "fsdp" / "snapshots" / "step-000002"),
                        model_weights(tmp_path / "one" / "snapshots" / "step-000002"), start_weights)
    best, best_one = read_info(tmp_path / "fsdp")["best"], read_info(tmp_path / "one")["best"]
    assert best["step"] == best_one["step"] and best["value"] == pytest.approx(best_one["value"], rel=1e-6)
    assert read_info(tmp_path / "fsdp")["world_size"] == 2 and out.count("done model") == 1
    assert "on 2 processes sharded by FSDP2, 1/2 of the weights on each" in out
    from transformers import AutoModelForCausalLM  # an ordinary directory: from_pretrained loads it

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp").num_parameters() > 0


@pytest.mark.slow
def test_fsdp_lora_on_two_ranks_equals_one_process(tmp_path, tiny_model_dir):
    """The frozen base is sharded with the adapters: only the adapters train, and they equal one process's."""
    from delft.recipe.files import load_recipe
    from delft.training.stages import run_training

    common = {"max_steps": 4, "save_steps": 2, "eval_steps": 2}
    loss = {"type": "del_prob", "weight": 0.5}
    one = recipe_file(tmp_path, tiny_model_dir, name="one", lora={"dropout": 0.0}, loss=loss,
                      train={**common, "grad_accum": 2})
    two = recipe_file(tmp_path, tiny_model_dir, name="two", lora={"dropout": 0.0}, loss=loss,
                      train={**common, "grad_accum": 1, "distributed": "fsdp"})
    out = finished(torchrun(two))
    run_training(load_recipe(one))
    a, b = adapter_weights(tmp_path / "two"), adapter_weights(tmp_path / "one")
    assert any(bool(v.abs().sum() > 0) for k, v in b.items() if "lora_B" in k)  # the adapters trained
    assert_same_weights(a, b)
    assert_same_log(tmp_path / "two", tmp_path / "one")
    assert "sharded by FSDP2" in out and out.count("done adapter") == 1
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "two")
    exported = run_cli("export", str(tmp_path / "two"), "--out", str(tmp_path / "merged"))  # and delft export
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "merged" / "config.json").is_file()


def killed_sharded_run(tmp_path: Path, model_dir: Path, name: str, train: dict) -> Path:
    """An fsdp run on 2 ranks whose rank 1 was killed (SIGKILL) after its first checkpoint: the run directory."""
    from delft.rundir import checkpoints

    recipe = recipe_file(tmp_path, model_dir, name=name, train=train)
    proc = torchrun(recipe)
    wait_for(lambda: len(checkpoints(tmp_path / name)) > 0, proc, "a checkpoint")
    workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    rank1 = [p for p in workers if b"RANK=1" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
    os.kill(rank1[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    assert checkpoints(tmp_path / name) and (checkpoints(tmp_path / name)[-1] / "sharded.json").is_file()
    return recipe


@pytest.mark.slow
def test_a_killed_rank_then_resume_at_two_and_at_one_rank_equals_the_uninterrupted_run(tmp_path, tiny_model_dir):
    train = {"finetuning": "full", "distributed": "fsdp", "max_steps": 40, "save_steps": 2, "eval_steps": 100,
             "logging_steps": 10}
    finished(torchrun(recipe_file(tmp_path, tiny_model_dir, name="straight", train=train)))
    straight = model_weights(tmp_path / "straight")
    again = killed_sharded_run(tmp_path, tiny_model_dir, "again", train)
    out = finished(start([sys.executable, "-m", "delft", "train", str(again), "--nproc", "2"]))
    assert "Resuming" in out
    assert_same_weights(model_weights(tmp_path / "again"), straight, model_weights(tiny_model_dir))
    alone = killed_sharded_run(tmp_path, tiny_model_dir, "alone", train)
    out = finished(start([sys.executable, "-m", "delft", "train", str(alone), "--nproc", "1",
                          "--set", "train.grad_accum=2"]))  # the same global batch on one rank
    assert "Resuming" in out and "instead of 2" in out
    assert_same_weights(model_weights(tmp_path / "alone"), straight)


@pytest.mark.slow
def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path, tiny_model_dir):
    """`delft train --nnodes 2 --node-rank R` started twice on this machine (localhost rendezvous): the run that
    node 0 writes equals the one-node, two-process run; node 1 writes nothing of its own."""
    train = {"finetuning": "full", "distributed": "fsdp", "max_steps": 4, "save_steps": 2, "eval_steps": 2}
    one_node = recipe_file(tmp_path, tiny_model_dir, name="one_node", train=train)
    two_nodes = recipe_file(tmp_path, tiny_model_dir, name="two_nodes", train=train)
    finished(torchrun(one_node))
    port = str(free_port())
    nodes = [start([sys.executable, "-m", "delft", "train", str(two_nodes), "--nproc", "1", "--nnodes", "2",
                    "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", port]) for r in (0, 1)]
    outs = [finished(p) for p in nodes]
    assert "on 2 processes" in outs[0] and "done model" in outs[0] and "done model" not in outs[1]
    assert_same_weights(model_weights(tmp_path / "two_nodes"), model_weights(tmp_path / "one_node"),
                        model_weights(tiny_model_dir))
    assert_same_log(tmp_path / "two_nodes", tmp_path / "one_node")


def test_a_node_rank_outside_the_nodes_is_refused(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir, train={"distributed": "fsdp", "finetuning": "full"})
    r = run_cli("train", str(recipe), "--nproc", "1", "--nnodes", "2", "--node-rank", "2")
    assert r.exit_code == 2 and "--node-rank 2 is not one of the 2 nodes" in " ".join(r.output.split())


def test_fsdp_without_a_launcher_is_refused_before_any_weights_load(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir, train={"distributed": "fsdp", "finetuning": "full"})
    r = run_cli("train", str(recipe))
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "this is one process that no launcher started" in text and "--nproc N" in text
    assert not (tmp_path / "run" / "delft_run.json").exists()


@pytest.mark.parametrize("section,values,needle", [
    ("quantization", {"mode": "nf4"}, "cannot shard bitsandbytes' packed nf4 weights"),
    ("train", {"cpu_offload": True, "distributed": "ddp"}, "cpu_offload moves FSDP's shards"),
    ("train", {"optimizer": "adamw_8bit"}, "cannot step FSDP's sharded weights (DTensors): use train.optimizer: adamw"),
    ("train", {"optimizer": "paged_adamw_8bit"}, "cannot step FSDP's sharded weights"),
    ("lora", {"init": "pissa"}, "which delft does on whole weights, not on FSDP's shards: use lora.init: default"),
    ("lora", {"init": "olora"}, "not on FSDP's shards"),
])
def test_what_fsdp_cannot_do_is_refused_in_the_recipe(tmp_path, tiny_model_dir, section, values, needle):
    """recipe check refuses it (and train with the same paragraph, before it relaunches under torchrun or takes
    the run's lock: no run directory is made)."""
    train = {"distributed": "fsdp"}
    if section == "train":
        train.update(values)
    recipe = recipe_file(tmp_path, tiny_model_dir, train=train, **({section: values} if section != "train" else {}))
    checked = run_cli("recipe", "check", str(recipe))
    assert checked.exit_code == 2 and needle in " ".join(checked.output.split())
    trained = run_cli("train", str(recipe), "--nproc", "2")
    assert trained.exit_code == 2 and " ".join(trained.output.split()) == " ".join(checked.output.split())
    assert not (tmp_path / "run").exists()


def test_quickstart_with_fsdp_and_pissa_is_refused_by_recipe_check():
    r = run_cli("recipe", "check", "--set", "train.distributed=fsdp", "--set", "lora.init=pissa", "--set",
                "quantization.mode=none", REPO / "recipes" / "quickstart.yaml")
    assert r.exit_code == 2 and "lora.init pissa changes the base weights" in " ".join(r.output.split())


def test_cpu_offload_on_the_cpu_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    from delft.errors import UserError
    from delft.recipe.files import load_recipe
    from delft.training.sharding import check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    offload = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="a",
                                      train={"distributed": "fsdp", "cpu_offload": True}))
    with pytest.raises(UserError, match="trains on the CPU already"):
        check_launch(offload, "cpu")


def test_nccl_asked_for_on_the_cpu_is_refused(monkeypatch):
    from delft.errors import UserError
    from delft.training.distributed import backend

    monkeypatch.setenv("DELFT_DIST_BACKEND", "nccl")
    with pytest.raises(UserError, match="this run trains on the CPU"):
        backend("cpu")
    monkeypatch.setenv("DELFT_DIST_BACKEND", "gloo")
    assert backend("cuda") == "gloo"
    monkeypatch.delenv("DELFT_DIST_BACKEND")
    assert backend("cpu") == "gloo" and backend("cuda") == "nccl"


def test_a_whole_weights_run_whose_checkpoint_holds_shards_is_refused_in_the_same_words(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    """The recipes agree (ddp) but the checkpoint's files are DCP's (one planted mark): the trainer's loader refuses
    it with the paragraph of a train.distributed mismatch (resume.other_layout), and deletes nothing."""
    from helpers import interrupt_on_step

    from delft.errors import UserError
    from delft.recipe.files import load_recipe
    from delft.rundir import latest_checkpoint
    from delft.training.stages import run_training

    path = recipe_file(tmp_path, tiny_model_dir, name="whole")
    restore = interrupt_on_step(monkeypatch, 3)
    with pytest.raises(SystemExit):
        run_training(load_recipe(path))
    restore()
    ckpt = latest_checkpoint(tmp_path / "whole")
    (ckpt / ".metadata").write_bytes(b"planted")
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(UserError) as e:
        run_training(load_recipe(path))
    text = " ".join(str(e.value).split())
    assert f"{ckpt} holds the shards of a train.distributed fsdp run, which this recipe's ddp cannot resume" in text
    assert "Resume it with train.distributed: fsdp (its recipe.yaml) under a launcher (--nproc N)" in text
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_a_ddp_checkpoint_is_not_resumed_sharded(tmp_path, tiny_model_dir, monkeypatch):
    from rich.console import Console

    from delft.errors import UserError
    from delft.recipe.files import load_recipe
    from delft.training.resume import check_resume

    saved = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="a"))
    sharded = load_recipe(recipe_file(tmp_path, tiny_model_dir, name="b", train={"distributed": "fsdp"}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="whole weights, which the other way cannot resume") as e:
        check_resume({"world_size": 2}, saved, sharded, ["train.distributed"], Console())
    assert "train.distributed: ddp" in str(e.value)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_at_one_step_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir):
    from delft.rundir import checkpoints

    train = {"finetuning": "full", "distributed": "fsdp", "max_steps": 40, "save_steps": 4, "eval_steps": 100,
             "logging_steps": 10}
    finished(torchrun(recipe_file(tmp_path, tiny_model_dir, name="straight", train=train)))
    cut = recipe_file(tmp_path, tiny_model_dir, name="cut", train=train)
    proc = torchrun(cut, start_new_session=True)
    wait_for(lambda: len(checkpoints(tmp_path / "cut")) > 0, proc, "a checkpoint")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the launcher and every rank get it
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "Resume with" in out, out[-3000:]
    last = checkpoints(tmp_path / "cut")[-1]
    assert (last / "sharded.json").is_file() and "Saved" in out
    out = finished(start([sys.executable, "-m", "delft", "train", str(cut), "--nproc", "2"]))
    assert "Resuming" in out
    assert_same_weights(model_weights(tmp_path / "cut"), model_weights(tmp_path / "straight"),
                        model_weights(tiny_model_dir))


SMOL = ["model.device=cpu", "data.synthetic.n=48", "data.val_size=8", "train.batch_size=2", "train.max_steps=2",
        "train.save_steps=2", "train.eval_steps=2", "train.logging_steps=1", "train.gradient_checkpointing=false"]


@pytest.mark.smollm2
@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_smollm2_on_two_ranks_of_two_micro_batches_equals_one_process_of_four(tmp_path, finetuning):
    """The real SmolLM2-135M (tied embeddings in the root unit), sharded on 2 ranks x 2 micro-batches against one
    unsharded process x 4: the same weights (to Adam's rounding bound) and the same log."""
    from helpers import assert_same_after_adam

    from delft.models.sources import ensure_smollm2

    quickstart = Path(__file__).parents[2] / "recipes" / "quickstart.yaml"
    how = (["train.finetuning=full", "lora.dropout=0.05", "train.learning_rate=2e-5"] if finetuning == "full"
           else ["train.learning_rate=5e-4"])
    sets = [a for s in SMOL + how for a in ("--set", s)]
    ensure_smollm2()
    one = finished(start([sys.executable, "-m", "delft", "train", str(quickstart), *sets, "--set",
                          "train.grad_accum=4", "--set", f"output.dir={tmp_path / 'one'}"]), timeout=900)
    two = finished(start([sys.executable, "-m", "delft", "train", str(quickstart), *sets, "--set",
                          "train.grad_accum=2", "--set", "train.distributed=fsdp", "--set",
                          f"output.dir={tmp_path / 'two'}", "--nproc", "2"]), timeout=900)
    assert "sharded by FSDP2" in two and "sharded" not in one
    read = model_weights if finetuning == "full" else adapter_weights
    a, b = read(tmp_path / "two"), read(tmp_path / "one")
    assert a.keys() == b.keys() and a
    lr = 2e-5 if finetuning == "full" else 5e-4
    for k in a:
        assert_same_after_adam(a[k], b[k], lr=lr, steps=2, rtol=RTOL, atol=ATOL, what=k)
    assert_same_log(tmp_path / "two", tmp_path / "one")


def test_recipe_check_plans_a_sharded_run_per_rank(tmp_path, tiny_model_dir):
    recipe = recipe_file(tmp_path, tiny_model_dir, train={"finetuning": "full"})
    plain = run_cli("recipe", "check", str(recipe), "--plan", "--world-size", "2")
    sharded = run_cli("recipe", "check", str(recipe), "--plan", "--world-size", "2", "--distributed", "fsdp")
    assert plain.exit_code == 0 and sharded.exit_code == 0, sharded.output
    assert "distributed: fsdp" in sharded.output and "fsdp" not in plain.output
    bad = run_cli("recipe", "check", str(recipe), "--distributed", "zero3")
    assert bad.exit_code == 2 and "train.distributed" in bad.output
