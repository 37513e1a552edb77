"""Where a run's weights live across its processes, chosen once from the recipe (``chosen``): whole on every rank
(``WholeWeights``: one process, or DDP), or split over the ranks (``Sharded``: FSDP2, delft.training.sharding).

The SFT loop (delft.training.sft) and the run lifecycle (delft.training.run) ask the placement, never
``train.distributed``, for what differs between the two:
- the module a step calls and how gradients are reduced (DDP all-reduces after the backward; FSDP reduce-scatters
  inside it);
- checkpoint save and load (rank 0's safetensors and trainer state; every rank's DCP shards);
- gathering the weights for generation and for a model directory, and which ranks take part in computing and
  saving (rank 0 alone; every rank, each holding a part of every layer);
- how the ranks agree on a signal (each stops at once; all stop together at a step's end, so all can save).

litgpt/Fabric's strategies and torchtune's ``ParallelDims`` are the model: the choice is made once, in setup, and
the loop reads the same for both.
"""

from __future__ import annotations

import contextlib
import signal as signals
from pathlib import Path
from typing import Optional

import torch

from delft.errors import UserError
from delft.models.loading import resolve_dtype
from delft.recipe.schema import Recipe
from delft.training import distributed as dist
from delft.training import sharded_checkpoints, sharding
from delft.training.checkpoints import load_checkpoint, restore_trainer_state, save_checkpoint, trainer_state
from delft.training.resume import other_layout


class Unreadable(Exception):
    """A checkpoint that cannot be read (truncated, a file missing): the loop tries the next older one."""


class WholeWeights:
    """Every rank holds the whole model (one process, or DDP): rank 0 alone validates, generates, writes checkpoints
    and model directories; the others only step, and load a checkpoint each."""

    sharded = False  # a signal stops a rank at once; its checkpoint is rank 0's alone

    def __init__(self, model, loss, recipe: Recipe, device: str):
        self.model = model

    @staticmethod
    def check_launch(recipe: Recipe, device: str) -> None:
        """Nothing: one process needs no launcher, and DDP's is checked when the process group starts."""

    @staticmethod
    def weights_dtype(recipe: Recipe, device: str) -> torch.dtype:
        return resolve_dtype(recipe.model.dtype, device)

    @property
    def module(self):
        """What a step's forward calls."""
        return self.model

    def describe(self) -> str:
        return ""

    def reduce_gradients(self, params: list) -> None:
        dist.all_reduce_grads(params)  # DDP: after every micro-batch's backward, once per step

    def involved(self) -> bool:
        """Whether this rank takes part in validation, generation and model directories."""
        return dist.is_main()

    def from_main(self, decided: bool) -> bool:
        """Rank 0's decision to write a model directory, on every rank that takes part in writing it."""
        return decided

    def gathered(self):
        """The weights whole for a call outside a step (generation): they are."""
        return contextlib.nullcontext()

    def save_pretrained(self, model, path: Optional[Path], initial_adapter: Optional[Path]) -> None:
        """The model (or adapter) as a user loads it, into ``path`` (None on the ranks that do not write): a
        pissa/olora adapter converted to apply to the original base (its checkpoints stay unconverted)."""
        if path is None:
            return
        if initial_adapter is None:
            model.save_pretrained(path)
        else:
            model.save_pretrained(path, path_initial_model_for_weight_conversion=str(initial_adapter))

    def load(self, ckpt: Path, optimizer, scheduler) -> tuple[int, dict]:
        """(step, the trainer's extra state) of ``ckpt``, loaded on every rank; Unreadable when it is damaged."""
        if sharded_checkpoints.is_sharded_checkpoint(ckpt):
            raise other_layout("fsdp", "ddp", ckpt)
        try:
            extra: dict = {}
            step = load_checkpoint(ckpt, self.model, optimizer, scheduler, extra)
            return step, extra
        except UserError:
            raise
        except Exception as e:  # truncated safetensors, a broken pickle, a missing file: many types
            raise Unreadable(f"{type(e).__name__}: {e}") from e

    def save(self, run_dir: Path, optimizer, scheduler, step: int, keep: int, rng: Optional[dict],
             extra: dict) -> Optional[Path]:
        """A checkpoint of ``step``, written by rank 0 (None on the others)."""
        if not dist.is_main():
            return None
        return save_checkpoint(run_dir, self.model, optimizer, scheduler, step, keep, rng, extra)

    def agree_on_signal(self, stops) -> None:
        """Nothing: a signal raises in the rank that got it (and a DDP launcher stops the others)."""


class Sharded:
    """FSDP2: each rank holds 1/N of every weight, gradient and optimizer state (delft.training.sharding). Every
    rank takes part in every step, validation, generation (the weights gathered) and save (its own shards, or the
    gathering of a model directory rank 0 writes), so the ranks stop together at a step's end."""

    sharded = True  # signals are recorded and agreed at a step's end: a rank that saved alone would wait forever

    def __init__(self, model, loss, recipe: Recipe, device: str):
        self.model = model
        self.root = sharding.shard(model, loss, recipe, device)  # the FSDP root (the model and the loss)

    check_launch = staticmethod(sharding.check_launch)

    @staticmethod
    def weights_dtype(recipe: Recipe, device: str) -> torch.dtype:
        return torch.float32  # fp32 shards, which the optimizer steps; on CUDA FSDP computes in bf16

    @property
    def module(self):
        return self.root

    def describe(self) -> str:
        return f"sharded by FSDP2, 1/{dist.world_size()} of the weights on each "

    def reduce_gradients(self, params: list) -> None:
        """Nothing: FSDP reduce-scatters the gradients in every backward."""

    def involved(self) -> bool:
        return True

    def from_main(self, decided: bool) -> bool:
        return bool(dist.all_reduce_floats([float(decided and dist.is_main())])[0])

    @contextlib.contextmanager
    def gathered(self):
        """The weights gathered for a call outside the root's forward (every rank enters it together)."""
        self.root.unshard()
        try:
            yield
        finally:
            self.root.reshard()

    def save_pretrained(self, model, path: Optional[Path], initial_adapter: Optional[Path]) -> None:
        """Gathered onto rank 0, which writes ``path``; the others pass None and only help gather (a collective).
        pissa/olora are refused under fsdp (the schema), so there is no initial adapter to convert against."""
        sharding.save_pretrained(self.root, path)

    def load(self, ckpt: Path, optimizer, scheduler) -> tuple[int, dict]:
        """Every file checked as data on every rank first (a planted one is refused, not loaded), then the shards
        loaded by DCP, any number of ranks having written them; Unreadable on every rank alike when damaged."""
        if not sharded_checkpoints.is_sharded_checkpoint(ckpt):
            raise other_layout("ddp", "fsdp", ckpt)
        metadata, state, damaged = self._checked_everywhere(ckpt)
        if damaged is None:
            try:
                sharded_checkpoints.load(ckpt, metadata, self.root, optimizer)
            except sharded_checkpoints.Damaged as e:  # DCP raises a failure on every rank together
                damaged = e
        if damaged is not None:
            raise Unreadable(f"{type(damaged).__name__}: {damaged}") from damaged
        return restore_trainer_state(state, scheduler, torch_rng=False)

    @staticmethod
    def _checked_everywhere(ckpt: Path) -> tuple:
        """(DCP's index, the trainer state, None) of a sharded checkpoint whose files every rank checked as data, or
        (None, None, why it cannot be read). The ranks agree before any of them enters DCP's load: one that saw a
        planted or damaged file where another did not must not leave the others waiting there."""
        metadata = state = damaged = refused = None
        try:
            metadata, state = sharded_checkpoints.check(ckpt)
        except sharded_checkpoints.Damaged as e:
            damaged = e
        except UserError as e:
            refused = e
        planted, broken = dist.all_reduce_floats([float(refused is not None), float(damaged is not None)])
        if planted:
            raise refused or UserError(f"another rank refused {ckpt} (see rank 0's message)", "output.dir",
                                       "Resume only runs you made; to start over, pass --force.")
        if broken:
            return None, None, damaged or sharded_checkpoints.Damaged("another rank could not read it")
        return metadata, state, None

    def save(self, run_dir: Path, optimizer, scheduler, step: int, keep: int, rng: Optional[dict],
             extra: dict) -> Optional[Path]:
        """Every rank writes its shards; rank 0 gets the checkpoint's path."""
        state = trainer_state(step, sharded_checkpoints.SHARDED_MARK, scheduler, rng, extra)
        return sharded_checkpoints.save(run_dir, self.root, optimizer, state, keep)

    def agree_on_signal(self, stops) -> None:
        """A signal is only recorded (the stage waits for signals) and the ranks stop together at the end of a
        step (its log line written), so every rank takes part in the checkpoint. A rank that got no signal itself
        stops as the others were asked to (SIGTERM if any rank got one: the code the launcher reports)."""
        mine = stops.received
        interrupts, terms = dist.all_reduce_floats([float(mine == signals.SIGINT), float(mine == signals.SIGTERM)])
        if interrupts == terms == 0:
            return
        if mine is None:
            stops.received = signals.SIGTERM if terms else signals.SIGINT
        raise KeyboardInterrupt


Placement = type[WholeWeights] | type[Sharded]


def chosen(recipe: Recipe) -> Placement:
    """The recipe's placement: the one reading of train.distributed in training (besides the launcher's)."""
    return Sharded if recipe.train.distributed == "fsdp" else WholeWeights


def local_value(x) -> float:
    """A float of a tensor that may be a DTensor (the gradient norm over sharded gradients)."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)
