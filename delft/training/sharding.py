"""Sharded training (train.distributed: fsdp) on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Weights, gradients and optimizer states are split over the ranks; each rank holds 1/N of them and gathers one
layer's weights at a time while it computes. The units: every decoder layer is one, then ``LossStep`` (the model
with delft's loss as one forward) is the root, holding the embeddings, the final norm and the output layer. The
root wraps the loss, not the model, because delft's loss reads the hidden states and calls the output layer itself
(never full-vocabulary logits), outside the model's own forward; FSDP gathers a unit's weights in the hooks of that
unit's forward, so the forward that must span the whole step is the loss's.

Gradients are summed over the ranks, not averaged (FSDP2's default): delft's loss is already normalised by the
whole optimizer batch's counts, all-reduced before the first backward as under ddp. So every unit has a divide
factor of 1 and a plain SUM reduction (a divide factor alone asks for PREMUL_SUM, which gloo lacks). Every
micro-batch's backward reduce-scatters, into the sharded gradients the next one adds to: skipping it until a step's
last micro-batch (``set_requires_gradient_sync``) would save communication but hold every layer's whole fp32
gradient on every rank meanwhile, the memory sharding is there to save. On CUDA the sharded weights are fp32 (the
optimizer's), compute runs in bf16 and gradients are reduced in fp32 (``MixedPrecisionPolicy``);
``train.cpu_offload`` keeps the shards in CPU memory between uses.

Checkpoints are sharded (delft.training.sharded_checkpoints, on ``torch.distributed.checkpoint``, read as data
only). The final model (or adapter) is gathered onto rank 0 and saved as an ordinary safetensors directory, as an
unsharded run saves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from delft.errors import UserError
from delft.models.loading import plain_model
from delft.training import distributed as dist
from delft.training.step import forward_sums

FULL_KEY_PREFIX = "model."  # LossStep's attribute: stripped from the gathered state dict's names


class LossStep(nn.Module):
    """The model and delft's loss as one module, so one FSDP root spans the decoder, the output layer and the loss.
    ``forward(batch)`` returns (CE sum, term sum, the Sums): the tensors first, so FSDP's backward hooks find them."""

    computes_loss = True  # delft.training.step.micro_sums calls it instead of the model

    def __init__(self, model: nn.Module, loss):
        super().__init__()
        self.model = model
        self.loss = loss  # delft.losses.loss.Loss: no parameters of its own

    def forward(self, batch: dict):
        sums = forward_sums(self.model, batch, self.loss)
        return sums.ce, sums.term, sums


def check_launch(recipe, device: str) -> None:
    """What sharding cannot do here (launch and device), refused before any weights load; what it cannot do with
    the recipe alone (nf4, grpo, pissa/olora, an 8-bit optimizer) the schema refuses (``Recipe._sharding``)."""
    if not dist.launched():
        raise UserError("train.distributed fsdp shards the model over several processes, and this is one process "
                        "that no launcher started", "train.distributed",
                        "Start it with --nproc N (or torchrun --nproc-per-node N -m delft train ...), or use "
                        "train.distributed: ddp for one process.")
    if recipe.train.cpu_offload and device != "cuda":
        raise UserError("train.cpu_offload keeps FSDP's shards in CPU memory to spare a GPU's, and this run trains "
                        "on the CPU already", "train.cpu_offload", "Drop train.cpu_offload (or set it to false).")


def decoder_layers(model) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (under a peft wrapper or not): one FSDP unit each."""
    layers = getattr(plain_model(model).get_decoder(), "layers", None)
    if layers is None:
        raise UserError(f"{type(plain_model(model)).__name__} keeps no decoder.layers list for FSDP to shard layer "
                        "by layer", "train.distributed", "Use train.distributed: ddp with this model.")
    return list(layers)


def shard(model: nn.Module, loss, recipe, device: str) -> LossStep:
    """Shard ``model`` in place (per decoder layer, then the LossStep root) and return the root."""
    options: dict = {}
    if device == "cuda":  # bf16 compute over fp32 shards; gradients reduced in fp32
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe.train.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    root = LossStep(model, loss)
    fully_shard(root, **options)
    for unit in root.modules():
        if isinstance(unit, FSDPModule):  # a sum over ranks: the loss is normalised globally already
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return root


def full_state_dict(root: LossStep) -> dict:
    """The whole model's state dict on rank 0, on the CPU, named as the unsharded model names it ({} elsewhere).
    A collective: every rank calls it."""
    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A tied weight (SmolLM2's output layer is its embedding) comes back once per name, as separate tensors that
    # save_pretrained cannot recognise as one: keep the first name, as the unsharded model's save keeps it.
    tied = ({n for n, _ in root.model.named_parameters(remove_duplicate=False)}
            - {n for n, _ in root.model.named_parameters()})
    return {k[len(FULL_KEY_PREFIX):]: v for k, v in full.items() if k[len(FULL_KEY_PREFIX):] not in tied}


def save_pretrained(root: LossStep, path: Optional[Path]) -> None:
    """The gathered model (or adapter) saved by rank 0 into ``path`` as ``save_pretrained`` writes it; the other
    ranks pass None and only take part in the gathering."""
    state = full_state_dict(root)
    if path is not None:
        root.model.save_pretrained(path, state_dict=state)
