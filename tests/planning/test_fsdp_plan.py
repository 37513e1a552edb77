"""delft.planning.fsdp: the per-rank memory plan under train.distributed fsdp (FSDP2), counted by hand on a tiny
config, its dependence on the world size, the first world size that fits a card, and the 8B worked example of
docs/fsdp_memory_plan.md. Every config is a dict written here: nothing is downloaded."""

import json
from pathlib import Path

import pytest
from rich.console import Console

from delft.planning.command import PlanDoesNotFit, run_plan
from delft.planning.fsdp import MAX_WORLD_SIZE, plan_fsdp, plan_per_rank
from delft.planning.knobs import suggest_knobs, world_size_fit
from delft.planning.memory import ALLOCATOR_SLACK, CUDA_CONTEXT, NCCL_BUFFERS, GiB, per_gpu, plan_memory, planned_nf4
from delft.recipe.schema import validate_recipe

# A Llama small enough to count by hand: head_dim 4, no biases, untied output layer.
#   one layer: q, k, v, o 8 x 8 = 64 each; gate, up 8 x 16 = 128 each; down 16 x 8 = 128; 2 norms of 8 -> 656
#   root: embeddings 32 x 8 = 256, output layer 256, final norm 8 -> 520; the model: 2 x 656 + 520 = 1,832
TINY = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 16, "vocab_size": 32, "tie_word_embeddings": False}
TINY_LAYER, TINY_ROOT, TINY_MODEL = 656, 520, 1832

# docs/fsdp_memory_plan.md's model: Llama-3-8B's shape (hidden 4096, 32 layers, 32 / 8 heads, vocab 128,256).
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "delft_number_tokens": 1110}


def fsdp(finetuning="full", **sections):
    base = {"model": {"dtype": "bfloat16"}, "data": {"max_length": 64},
            "train": {"finetuning": finetuning, "distributed": "fsdp", "batch_size": 2, "fused_loss": "off"}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return validate_recipe(base)


def llama8b(**train):
    return validate_recipe({"model": {"dtype": "bfloat16"}, "data": {"max_length": 2048},
                            "train": {"finetuning": "full", "distributed": "fsdp", "optimizer": "adamw",
                                      "batch_size": 1, "gradient_checkpointing": True, "fused_loss": "off",
                                      **train}})


def test_full_finetuning_shards_counted_by_hand():
    """fp32 master weights (4) + fp32 gradients (4) + AdamW's two fp32 moments (8) = 16 bytes a parameter, / N."""
    for n in (1, 3, 4):
        p = plan_fsdp(TINY, fsdp(), n)
        assert p["sharded_weights"] == int(TINY_MODEL * 4 / n)
        assert p["sharded_trained"] == int(TINY_MODEL * 12 / n)
        assert p["sharded_state"] == int(TINY_MODEL * 16 / n)
    p = plan_fsdp(TINY, fsdp(), 4)
    assert p["sharded_state"] == 7328 and p["on_cpu"] == 0
    assert p["gathered_root"] == TINY_ROOT * 2  # bf16, whatever the world size
    assert p["gathered_layers"] == 2 * TINY_LAYER * 2  # the computing layer and the prefetched one
    assert p["output_grad"] == 32 * 8 * 2  # the output layer's unsharded bf16 gradient
    assert p["layer_grads"] == TINY_LAYER * (2 + 4)  # bf16 gradient + its fp32 reduce-scatter input
    assert p["root_reduce"] == TINY_ROOT * (2 + 4)
    sgd = plan_fsdp(TINY, fsdp(train={"optimizer": "sgd", "momentum": 0.0}), 4)
    assert sgd["sharded_state"] == TINY_MODEL * 8 // 4  # no optimizer state: weights and gradients only


def test_lora_shards_counted_by_hand():
    """The frozen base in fp32 / N (the trainer loads the model in fp32 under fsdp); r=2 adapters on all 7
    projections: 2 x (8+8) x 4 + 2 x (8+16) x 3 = 272 per layer, fp32 weight + gradient + two moments = 16 bytes
    each, / N."""
    r = fsdp("lora", lora={"r": 2, "dropout": 0.0, "target_modules": "all-linear"})
    assert not planned_nf4(r)  # quantization auto never means nf4 under fsdp
    p = plan_fsdp(TINY, r, 2)
    assert p["sharded_weights"] == TINY_MODEL * 4 // 2
    assert p["sharded_trained"] == 2 * 272 * 16 // 2
    assert p["gathered_layers"] == 2 * (TINY_LAYER + 272) * 2
    assert p["gathered_root"] == TINY_ROOT * 2
    assert p["output_grad"] == 0 and p["root_reduce"] == 0  # nothing in the root is trained
    assert p["layer_grads"] == 272 * 6
    saved = plan_fsdp(TINY, fsdp("lora", lora={"r": 2, "dropout": 0.0, "modules_to_save": ["lm_head"]}), 2)
    assert saved["output_grad"] == 256 * 2 and saved["root_reduce"] == 256 * 6
    assert saved["sharded_trained"] == (2 * 272 * 16 + 256 * 16) // 2  # the copy: fp32 weight, gradient, moments
    assert saved["gathered_root"] == (TINY_ROOT + 256) * 2  # the trainable copy is gathered with the root


def test_components_add_up_to_the_peak():
    for r, n in ((fsdp(), 4), (fsdp("lora", lora={"dropout": 0.0}), 2), (llama8b(), 8), (fsdp(), 1)):
        cfg = LLAMA3_8B if r.data.max_length == 2048 else TINY
        p = plan_fsdp(cfg, r, n)
        backward = (p["gathered_root"] + p["gathered_layers"] + p["activations"] + p["output_grad"]
                    + max(p["loss"], p["layer_backward"] + p["layer_grads"]))
        assert p["peak_allocated"] == pytest.approx(p["sharded_state"] + max(backward, p["root_reduce"]), abs=8)
        assert p["total"] == pytest.approx(p["peak_allocated"] * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT
                                           + NCCL_BUFFERS * (n > 1), abs=8)


def test_fsdp_computes_in_bf16_over_fp32_shards_whatever_model_dtype_says():
    """sharding.shard's MixedPrecisionPolicy is bf16 on CUDA and build_model loads fp32 under fsdp, so model.dtype
    float32 plans as bfloat16 does; under ddp it doubles the activations."""
    r32 = fsdp(model={"dtype": "float32"})
    assert plan_fsdp(TINY, r32, 2) == plan_fsdp(TINY, fsdp(), 2)
    ddp = {**r32.to_dict()["train"], "distributed": "ddp"}
    ddp32 = plan_memory(TINY, validate_recipe({**r32.to_dict(), "train": ddp}))
    assert ddp32["activations"] == 2 * plan_fsdp(TINY, r32, 2)["activations"]


def test_activations_and_loss_are_per_rank_as_under_ddp():
    r = fsdp(data={"max_length": 128}, train={"batch_size": 4})
    ddp = plan_memory(TINY, validate_recipe({**r.to_dict(), "train": {**r.to_dict()["train"],
                                                                       "distributed": "ddp"}}))
    for n in (1, 2, 8):
        p = plan_fsdp(TINY, r, n)
        assert (p["activations"], p["loss"], p["layer_backward"]) == \
            (ddp["activations"], ddp["loss"], ddp["layer_backward"])


def test_more_ranks_never_cost_more_and_only_the_shards_shrink():
    r = llama8b()
    plans = [plan_fsdp(LLAMA3_8B, r, n) for n in range(1, MAX_WORLD_SIZE + 1)]
    totals = [p["total"] for p in plans]
    assert all(a > b for a, b in zip(totals, totals[1:])), totals
    for n, p in enumerate(plans, start=1):
        assert p["sharded_state"] * n == pytest.approx(plans[0]["sharded_state"], abs=n)
        assert p["gathered_root"] == plans[0]["gathered_root"] and p["activations"] == plans[0]["activations"]
    small = [plan_fsdp(TINY, fsdp(), n)["sharded_state"] for n in range(1, 17)]
    assert all(a >= b for a, b in zip(small, small[1:]))


def test_gradient_accumulation_changes_no_plan():
    """Every micro-batch's backward reduce-scatters into the sharded gradients (sharding's docstring), so no
    unsharded gradient is held between micro-batches: the per-rank peak is the same for grad_accum 1 and 4, under
    fsdp as under ddp, and accumulation is never a knob to turn."""
    for r1, r4, n in ((fsdp(), fsdp(train={"grad_accum": 4}), 1), (fsdp(), fsdp(train={"grad_accum": 4}), 8),
                      (fsdp("lora", lora={"r": 2, "dropout": 0.0}),
                       fsdp("lora", lora={"r": 2, "dropout": 0.0}, train={"grad_accum": 4}), 2)):
        assert plan_fsdp(TINY, r4, n) == plan_fsdp(TINY, r1, n)
    assert plan_fsdp(LLAMA3_8B, llama8b(grad_accum=4), 8) == plan_fsdp(LLAMA3_8B, llama8b(), 8)
    assert plan_fsdp(LLAMA3_8B, llama8b(grad_accum=4, cpu_offload=True), 8) == \
        plan_fsdp(LLAMA3_8B, llama8b(cpu_offload=True), 8)
    ddp = {"model": {"dtype": "bfloat16"}, "train": {"finetuning": "full", "fused_loss": "off"}}
    ddp4 = validate_recipe({**ddp, "train": {**ddp["train"], "grad_accum": 4}})
    assert plan_per_rank(TINY, ddp4, 4) == plan_per_rank(TINY, validate_recipe(ddp), 4)
    fit = world_size_fit(LLAMA3_8B, llama8b(grad_accum=4), False, 24 * GiB)
    assert fit == world_size_fit(LLAMA3_8B, llama8b(), False, 24 * GiB) and fit["world_size"] == 9
    knobs = suggest_knobs(LLAMA3_8B, llama8b(grad_accum=4), 24 * GiB, False, True, world_size=8)
    assert knobs == suggest_knobs(LLAMA3_8B, llama8b(), 24 * GiB, False, True, world_size=8)
    assert not any("grad_accum" in k["knob"] for k in knobs)


def test_cpu_offload_moves_the_shards_off_the_gpu():
    on, off = plan_fsdp(LLAMA3_8B, llama8b(cpu_offload=True), 8), plan_fsdp(LLAMA3_8B, llama8b(), 8)
    assert on["on_cpu"] == on["sharded_state"] == off["sharded_state"]
    assert on["peak_allocated"] == pytest.approx(off["peak_allocated"] - off["sharded_state"], abs=4)


def test_ddp_plan_is_unchanged_and_fsdp_at_one_rank_costs_more():
    r = validate_recipe({"model": {"dtype": "bfloat16"}, "train": {"finetuning": "full", "fused_loss": "off"}})
    assert plan_per_rank(TINY, r, 4) == per_gpu(plan_memory(TINY, r), 4)
    one_ddp = plan_memory(TINY, r)
    one_fsdp = plan_fsdp(TINY, fsdp(data={"max_length": r.data.max_length}, train={"batch_size": 8}), 1)
    # DDP: bf16 weights + bf16 gradients + fp32 moments = 12 bytes; FSDP: fp32 master + fp32 gradient + moments
    assert one_ddp["weights_16bit"] + one_ddp["lora_optimizer"] == TINY_MODEL * 12
    assert one_fsdp["sharded_state"] == TINY_MODEL * 16


def test_first_fitting_world_size_for_a_made_up_card():
    r = llama8b()
    card = plan_fsdp(LLAMA3_8B, r, 5)["total"]  # a card that holds exactly the 5-rank plan
    fit = world_size_fit(LLAMA3_8B, r, False, card)
    assert fit["world_size"] == 5 and fit["power_of_two"] == 8 and fit["helps"] == []
    assert plan_fsdp(LLAMA3_8B, r, 4)["total"] > card
    assert fit["tried"] == "every world size 1..64"
    assert world_size_fit(LLAMA3_8B, r, False, card - 1)["world_size"] == 6


def test_a_card_no_world_size_fits_says_what_would_help():
    r = llama8b()
    card = 8 * GiB
    assert plan_fsdp(LLAMA3_8B, r, MAX_WORLD_SIZE)["total"] > card
    fit = world_size_fit(LLAMA3_8B, r, False, card)
    assert fit["world_size"] is None and fit["power_of_two"] is None
    assert fit["total_at_max"] == plan_fsdp(LLAMA3_8B, r, MAX_WORLD_SIZE)["total"]
    helps = {h["change"]: h["world_size"] for h in fit["helps"]}
    assert set(helps) == {"train.cpu_offload: true", "train.finetuning: lora",
                          "train.cpu_offload: true + train.finetuning: lora"}  # checkpointing is already on
    lora = helps["train.finetuning: lora"]
    assert lora is not None and plan_fsdp(LLAMA3_8B, llama8b(finetuning="lora"), lora)["total"] <= card
    no_ckpt = world_size_fit(LLAMA3_8B, llama8b(gradient_checkpointing=False), False, card)
    assert "train.gradient_checkpointing: true" in {h["change"] for h in no_ckpt["helps"]}


def test_knobs_under_fsdp_offer_cpu_offload_never_nf4():
    r = fsdp("lora", quantization={"mode": "none"}, lora={"dropout": 0.0})
    n = 2
    total = plan_fsdp(TINY, r, n)["total"]
    knobs = suggest_knobs(TINY, r, total - 1, False, True, world_size=n)
    names = [k["knob"] for k in knobs]
    assert "quantization.mode" not in " ".join(names)
    for k in knobs:
        assert k["total"] < total
    r8 = llama8b()
    knobs = suggest_knobs(LLAMA3_8B, r8, 24 * GiB, False, True, world_size=8)
    offload = next(k for k in knobs if k["knob"] == "train.cpu_offload")
    assert offload["total"] == plan_fsdp(LLAMA3_8B, llama8b(cpu_offload=True), 8)["total"] <= 24 * GiB
    assert "train.optimizer" not in [k["knob"] for k in knobs]  # fsdp refuses bitsandbytes' 8-bit AdamW
    ddp = validate_recipe({**r8.to_dict(), "train": {**r8.to_dict()["train"], "distributed": "ddp"}})
    assert "train.optimizer" in [k["knob"] for k in suggest_knobs(LLAMA3_8B, ddp, 80 * GiB, False, True)]


def _model(tmp_path, config) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_run_plan_reads_distributed_from_the_recipe_and_reports_the_fit(tmp_path):
    model = _model(tmp_path, LLAMA3_8B)
    r = validate_recipe({"model": {"name": str(model), "dtype": "bfloat16"}, "data": {"max_length": 2048},
                         "train": {"finetuning": "full", "distributed": "fsdp", "batch_size": 1,
                                   "fused_loss": "off"}})
    console = Console(record=True, width=200)
    result = run_plan(r, "80GiB", console, world_size=8)
    assert result["distributed"] == "fsdp" and result["fits"] is True
    assert result["components"] == plan_fsdp(LLAMA3_8B, r, 8)
    fit = result["world_size_fit"]
    assert fit["world_size"] is not None and fit["world_size"] <= 8
    text = " ".join(console.export_text().split())
    assert "per rank of 8 (fsdp)" in text and "gathered root" in text and "weights, sharded" in text
    assert f"first fits 80.00 GiB per rank at world size {fit['world_size']}" in text
    assert "not yet measured on a GPU" in text
    with pytest.raises(PlanDoesNotFit) as e:
        run_plan(r, "24GiB", Console(record=True, width=200), world_size=2)
    n = e.value.plan["world_size_fit"]["world_size"]
    assert n > 2 and f"--world-size {n}" in e.value.fix
    ddp = run_plan(validate_recipe({**r.to_dict(), "train": {**r.to_dict()["train"], "distributed": "ddp"}}),
                   None, Console(record=True, width=200), world_size=2)
    assert "world_size_fit" not in ddp and ddp["components"]["nccl_buffers"] == NCCL_BUFFERS


def test_the_8b_worked_example():
    """docs/fsdp_memory_plan.md: Llama-3-8B, full fine-tuning, bf16, AdamW, checkpointing, 1 x 2048 tokens."""
    r = llama8b()
    p = plan_fsdp(LLAMA3_8B, r, 8)
    params = 8_030_261_248  # 32 x 218,112,000 per layer + 2 x 128,256 x 4,096 + 4,096
    assert p["sharded_state"] == params * 16 // 8
    assert p["gathered_root"] == (2 * 128256 * 4096 + 4096) * 2
    assert p["gathered_layers"] == 2 * 218_112_000 * 2
    assert p["activations"] == 33 * 2048 * 4096 * 2  # 32 layer inputs + the embedding output, bf16
    assert p["total"] > 24 * GiB  # 8 ranks of 24 GiB fall just short
    fit = world_size_fit(LLAMA3_8B, r, False, 24 * GiB)
    assert (fit["world_size"], fit["power_of_two"]) == (9, 16)
    doc = " ".join((Path(__file__).parents[2] / "docs" / "fsdp_memory_plan.md").read_text().split())
    assert "## The memory plan under fsdp" in doc
    assert f"{p['total'] / GiB:.2f}" in doc and f"{p['sharded_state'] / GiB:.2f}" in doc
    assert "world size 9" in doc and "not yet measured on a GPU" in doc
