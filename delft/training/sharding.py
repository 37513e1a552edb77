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

Checkpoints are sharded (``torch.distributed.checkpoint``): every rank writes its shards into one staged directory,
rank 0 adds the trainer state and renames it into place, so a checkpoint is whole or not there, and a different
number of ranks re-shards it on load. The final model (or adapter) is gathered onto rank 0 and saved as an ordinary
safetensors directory, as an unsharded run saves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from delft import rundir
from delft.errors import UserError
from delft.models.loading import MUTATING_INITS, plain_model
from delft.outputs import follow_umask, publish, temporary_sibling
from delft.training import distributed as dist
from delft.training.checkpoints import check_free_space
from delft.training.step import forward_sums

SHARDED_MARK = "sharded.json"  # in a sharded checkpoint: the world size that wrote it (DCP's files beside it)
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
    """What sharding cannot do here, refused before any weights load."""
    if not dist.launched():
        raise UserError("train.distributed fsdp shards the model over several processes, and this is one process "
                        "that no launcher started", "train.distributed",
                        "Start it with --nproc N (or torchrun --nproc-per-node N -m delft train ...), or use "
                        "train.distributed: ddp for one process.")
    if recipe.train.cpu_offload and device != "cuda":
        raise UserError("train.cpu_offload keeps FSDP's shards in CPU memory to spare a GPU's, and this run trains "
                        "on the CPU already", "train.cpu_offload", "Drop train.cpu_offload (or set it to false).")
    if recipe.train.finetuning == "lora" and not recipe.model.adapter and recipe.lora.init in MUTATING_INITS:
        raise UserError(f"lora.init {recipe.lora.init} changes the base weights and converts the adapter against "
                        "them at the end, which delft does on whole weights, not on FSDP's shards", "lora.init",
                        "Use lora.init: default (or gaussian) with train.distributed fsdp, or train it with ddp.")
    if recipe.train.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        raise UserError(f"train.optimizer {recipe.train.optimizer} is bitsandbytes' optimizer, which cannot step "
                        "FSDP's sharded weights (DTensors)", "train.optimizer",
                        "Use train.optimizer: adamw with train.distributed fsdp (its states are sharded too).")


def decoder_layers(model) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (under a peft wrapper or not): one FSDP unit each."""
    layers = getattr(plain_model(model).get_decoder(), "layers", None)
    if layers is None:
        raise UserError(f"{type(plain_model(model)).__name__} keeps no decoder.layers list for FSDP to shard layer "
                        "by layer", "train.distributed", "Use train.distributed: ddp with this model.")
    return list(layers)


def shard(model: nn.Module, loss, recipe, device: str) -> LossStep:
    """Shard ``model`` in place (per decoder layer, then the LossStep root) and return the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

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


def describe(root: Optional[LossStep]) -> str:
    """'sharded by FSDP2, 1/N of the weights on each ' for the training line; '' unsharded."""
    return f"sharded by FSDP2, 1/{dist.world_size()} of the weights on each " if root is not None else ""


def local_value(x) -> float:
    """A float of a tensor that may be a DTensor (the gradient norm over sharded gradients)."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


class Gathered:
    """The weights gathered for rank 0's use: ``with Gathered(root):`` around generation or a save that calls the
    model outside the root's forward (every rank must enter it together)."""

    def __init__(self, root: Optional[LossStep]):
        self.root = root

    def __enter__(self):
        if self.root is not None:
            self.root.unshard()
        return self

    def __exit__(self, *exc):
        if self.root is not None:
            self.root.reshard()


def full_state_dict(root: LossStep) -> dict:
    """The whole model's state dict on rank 0, on the CPU, named as the unsharded model names it ({} elsewhere).
    A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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


def _sharded_states(root: LossStep, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(root), "optimizer": get_optimizer_state_dict(root, optimizer)}


def _local_bytes(root: LossStep, optimizer) -> int:
    """This rank's shards of the weights and of the optimizer's states: its part of a checkpoint."""
    def size(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    states = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(size(p) for p in root.parameters()) + sum(size(v) for v in states)


def _staging_dir(final: Path) -> Path:
    """Rank 0's temporary name for ``final``, the same on every rank (its pid marks a dead run's leftover)."""
    import torch.distributed as tdist

    name = [str(temporary_sibling(final))] if dist.is_main() else [None]
    tdist.broadcast_object_list(name, src=0)
    return Path(name[0])


def save_checkpoint(run_dir: Path, root: LossStep, optimizer, trainer_state: dict, keep: int) -> Optional[Path]:
    """Every rank's shards and rank 0's trainer state (step, scheduler, RNG, extra) into one staged directory,
    renamed into place by rank 0 once all have written: the checkpoint (on rank 0; None elsewhere)."""
    import torch.distributed.checkpoint as dcp

    final = rundir.checkpoint_path(run_dir, trainer_state["step"])
    # every rank checks the whole checkpoint's size against the shared disk, so all refuse together, none hangs
    need = dist.all_reduce_floats([float(_local_bytes(root, optimizer))])[0]
    final.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(final.parent, int(need) + 2**20, "checkpoint")
    tmp = _staging_dir(final)
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier("the checkpoint's directory")
    dcp.save(_sharded_states(root, optimizer), checkpoint_id=str(tmp))
    dist.barrier("the checkpoint's shards")
    if not dist.is_main():
        return None
    (tmp / SHARDED_MARK).write_text(json.dumps({"world_size": dist.world_size()}))
    torch.save(trainer_state, tmp / rundir.STATE_FILE)  # last: a checkpoint is complete once its state file is there
    follow_umask(tmp)
    publish(tmp, final)
    for old in rundir.checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def is_sharded_checkpoint(ckpt: Path) -> bool:
    return (Path(ckpt) / SHARDED_MARK).is_file()


def load_checkpoint(ckpt: Path, root: LossStep, optimizer) -> None:
    """The shards of ``ckpt`` into this rank's part of the model and optimizer, re-sharded when the checkpoint was
    written by another number of ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = _sharded_states(root, optimizer)
    dcp.load(states, checkpoint_id=str(ckpt))
    set_model_state_dict(root, states["model"])
    set_optimizer_state_dict(root, optimizer, states["optimizer"])
