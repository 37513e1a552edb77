"""Peak GPU memory per rank under ``train.distributed: fsdp`` (PyTorch FSDP2), from the model's config.json alone.

The trainer (delft.training.sharding) calls ``fully_shard`` on each decoder layer, then on the root, LossStep (the
model with delft's loss), which keeps the embeddings, the final norm and the output layer. It loads the model in
fp32 under fsdp (training.setup.build_model), and on CUDA it computes with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), whatever model.dtype says. Per rank of a world of N:

  sharded      weights, gradients and optimizer states, each split evenly over the N ranks: fp32 weights (the
               frozen base of LoRA too), and for the trained ones fp32 gradients and the optimizer's state, which
               steps on the fp32 shards. With train.cpu_offload all of it lives in CPU memory (reported as on_cpu,
               not on the GPU).
  gathered     the root's parameters in bf16, all-gathered for the whole step (the root is not
               resharded after forward), and two decoder layers: the one computing and the one FSDP2 prefetches
  activations  each rank's own micro-batch, as under DDP with bf16 compute (memory.layer_bytes)
  then the larger of two phases:
    backward   the gathered parameters and the activations, plus the larger of the loss and the recomputed layer
               (memory.loss_bytes, memory.layer_bytes), each with its gradients in flight. The output layer's
               unsharded gradient, when it is trained, is made in the loss's backward and held until the root's
               reduce-scatter. The layer adds its own unsharded gradient in bf16 and the fp32
               reduce-scatter input FSDP2 keeps until the next layer's reduce-scatter.
    root reduce  the end of the backward. The activations are freed, and so are the gathered parameters, because
               FSDP2 reshards each group before its reduce-scatter. What remains is the root's unsharded gradients
               and their fp32 reduce-scatter input (full fine-tuning: embeddings and output layer; LoRA:
               modules_to_save).

train.grad_accum changes none of it. Every micro-batch's backward reduce-scatters into the sharded gradients
(sharding's module docstring), so no unsharded gradient outlives the backward that made it, and one micro-batch's
activations are what train.batch_size sets. Accumulation costs communication, not memory.

FSDP2 pads each parameter's first dimension to a multiple of N. That padding is not counted. Neither is the
host-to-device copy of a layer's shard under cpu_offload (one layer / N). These terms are counted from FSDP2's
design and have not been measured on a GPU.
"""

from __future__ import annotations

import math

from delft.planning.memory import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    LORA_BYTES,
    NCCL_BUFFERS,
    dtype_bytes,
    layer_bytes,
    lora_parameters,
    loss_bytes,
    per_gpu,
    plan_memory,
    saved_parameters,
    state_bytes,
)
from delft.planning.shapes import model_shape, parameter_counts
from delft.recipe.schema import validate_recipe

# The sharded weights: the trainer loads the model in fp32 under fsdp (LoRA's frozen base too), so the gradient
# shards are fp32 as well. The optimizer steps on these shards.
MASTER_BYTES = 4


# MixedPrecisionPolicy param_dtype bf16 (sharding.shard, on CUDA): the gathered weights, the activations and the
# unsharded gradients, whatever model.dtype says.
COMPUTE_BYTES = 2


# MixedPrecisionPolicy reduce_dtype fp32: each unsharded gradient is copied into an fp32 reduce-scatter input.
REDUCE_BYTES = 4


# Decoder layers unsharded at once: the one computing, and the next one FSDP2 all-gathers ahead of it (implicit
# prefetch in forward, backward prefetch in backward).
GATHERED_LAYERS = 2


# The largest world size world_size_fit tries. It tries every integer up to this, because FSDP2 shards over any
# count.
MAX_WORLD_SIZE = 64


def fsdp_parameters(s: dict, recipe) -> dict:
    """Parameter counts of FSDP2's groups for a ``model_shape``.

    root is the embeddings, the output layer (unless tied) and the final norm; layer is one decoder layer (its
    projections, experts included, its norms and biases). base is the whole model. The trained counts are all of
    them under full fine-tuning; under LoRA, a layer's adapters and modules_to_save's copies, which sit in the root.
    """
    H, L, V = s["hidden"], s["layers"], s["vocab"]
    linear, other = parameter_counts(s)
    root = V * H * (1 if s["tied"] else 2) + H
    layer = (linear + other - root) // L  # every per-layer term is a multiple of L
    if recipe.train.finetuning == "full":
        return dict(root=root, layer=layer, base=linear + other, adapters=0, saved=0, root_trained=root,
                    layer_trained=layer, output_trained=V * H)
    lo = recipe.lora
    adapters, saved = lora_parameters(s, lo), saved_parameters(s, lo)
    return dict(root=root + saved, layer=layer + adapters // L, base=linear + other, adapters=adapters, saved=saved,
                root_trained=saved, layer_trained=adapters // L,
                output_trained=V * H if "lm_head" in lo.modules_to_save else 0)


def _sharded_bytes(p: dict, recipe) -> tuple[float, float]:
    """(weights, trained state) in bytes over all ranks together. The weights are the whole model in fp32. The
    trained state is, under full fine-tuning, every weight's fp32 gradient and optimizer state. Under LoRA it is the
    fp32 adapters with their gradients and optimizer state, and modules_to_save's fp32 copies with theirs."""
    per_trained = MASTER_BYTES + state_bytes(recipe)
    if recipe.train.finetuning == "full":
        return p["base"] * MASTER_BYTES, p["base"] * per_trained
    return p["base"] * MASTER_BYTES, p["adapters"] * (LORA_BYTES - 8 + state_bytes(recipe)) + p["saved"] * (
        MASTER_BYTES + per_trained)


def _computing(recipe):
    """The recipe as FSDP computes it on CUDA: in bf16, whatever model.dtype says (for the DDP plan's activation,
    loss and layer terms, which read model.dtype)."""
    if dtype_bytes(recipe.model.dtype) == COMPUTE_BYTES:
        return recipe
    data = recipe.to_dict()
    data["model"]["dtype"] = "bfloat16"
    return validate_recipe(data)


def plan_fsdp(config: dict, recipe, world_size: int, fused: bool = False, label_fraction: float = 1.0) -> dict:
    """Components of one rank's peak GPU memory under train.distributed fsdp over ``world_size`` ranks, in bytes.

    Pure: no files, no torch. ``config``, ``fused`` and ``label_fraction`` have the same meaning as for
    memory.plan_memory. Keys: world_size, sharded_weights and sharded_trained (this rank's shards, wherever they
    live), sharded_state (their sum), on_cpu (the part in CPU memory under cpu_offload), gathered_root,
    gathered_layers, activations, loss, layer_backward, output_grad, layer_grads, root_reduce, peak_allocated,
    allocator_slack, cuda_context, nccl_buffers, total. train.grad_accum is not read: see the module docstring.
    """
    n = max(1, world_size)
    s = model_shape(config)
    p = fsdp_parameters(s, recipe)
    c = COMPUTE_BYTES
    tokens = recipe.train.batch_size * recipe.data.max_length
    n_lab = max(1, math.ceil(tokens * label_fraction))
    weights, trained = (b / n for b in _sharded_bytes(p, recipe))
    on_cpu = weights + trained if recipe.train.cpu_offload else 0
    gathered_root = p["root"] * c
    gathered_layers = min(GATHERED_LAYERS, s["layers"]) * p["layer"] * c
    activations, layer_backward = layer_bytes(s, _computing(recipe), fused, tokens)
    loss = loss_bytes(s, _computing(recipe), fused, tokens, n_lab)
    output_grad = p["output_trained"] * c
    layer_grads = p["layer_trained"] * (c + REDUCE_BYTES)
    root_reduce = p["root_trained"] * (c + REDUCE_BYTES)  # the layers' are reduced by then
    backward = gathered_root + gathered_layers + activations + output_grad + max(loss, layer_backward + layer_grads)
    peak = weights + trained - on_cpu + max(backward, root_reduce)
    slack = peak * ALLOCATOR_SLACK
    nccl = NCCL_BUFFERS if n > 1 else 0
    comp = dict(world_size=n, sharded_weights=weights, sharded_trained=trained, sharded_state=weights + trained,
                on_cpu=on_cpu, gathered_root=gathered_root, gathered_layers=gathered_layers, activations=activations,
                loss=loss, layer_backward=layer_backward, output_grad=output_grad, layer_grads=layer_grads,
                root_reduce=root_reduce, peak_allocated=peak,
                allocator_slack=slack, cuda_context=CUDA_CONTEXT, nccl_buffers=nccl,
                total=peak + slack + CUDA_CONTEXT + nccl)
    return {k: int(v) for k, v in comp.items()}


def plan_per_rank(config: dict, recipe, world_size: int = 1, fused: bool = False) -> dict:
    """One rank's plan by the recipe's train.distributed: ``plan_fsdp``, or for ddp one process's ``plan_memory``
    with NCCL's buffers added (``per_gpu``)."""
    if recipe.train.distributed == "fsdp":
        return plan_fsdp(config, recipe, world_size, fused)
    return per_gpu(plan_memory(config, recipe, fused), world_size)
