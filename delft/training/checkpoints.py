"""Checkpoints: adapter (or, fully fine-tuned, the model) + optimizer + scheduler + RNG states written to a temporary directory and renamed into
place, the free-space check before, and loading one back for an exact resume.
"""

from __future__ import annotations

import pickle
import random
import shutil
from pathlib import Path
from typing import Optional

from delft import rundir
from delft.errors import UserError
from delft.outputs import follow_umask, no_space_is_a_user_error, staged


def rng_states() -> dict:
    import torch

    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def trainer_state(step: int, optimizer_state, scheduler, rng: Optional[dict] = None,
                  extra: Optional[dict] = None) -> dict:
    """What every checkpoint carries beside the weights, one-process and sharded alike (trainer_state.pt): the step,
    the optimizer's state (a sharded checkpoint's is in its shards: ``optimizer_state`` marks them), the scheduler,
    the RNG states to resume with (``rng``; default the current ones) and the trainer's extra state."""
    return {"step": step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "rng": rng or rng_states(), "extra": extra or {}}


def restore_trainer_state(state: dict, scheduler, optimizer=None, torch_rng: bool = True) -> tuple[int, dict]:
    """``trainer_state``'s inverse: (the step, the extra state), the scheduler, the optimizer (unless its state is
    in shards, loaded with them) and the RNGs restored."""
    import torch

    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    # A sharded run always has a launcher, and then every step re-seeds torch's generators from (seed, rank, step)
    # (distributed.seed_step) before it draws: a restored torch state would be overwritten unused.
    if torch_rng:
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return int(state["step"]), state.get("extra") or {}


def adapter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def final_bytes(model, tokenizer) -> int:
    """What a model (or adapter) directory with its tokenizer takes on disk, with a MiB to spare: the trainable
    weights and the tokenizer's own file (its JSON, as save_pretrained writes it), so a small volume that holds them
    is not refused."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tokenizer_bytes = len(backend.to_str().encode()) if backend is not None else 2**23  # slow tokenizers: a guess
    return adapter_bytes(model) + tokenizer_bytes + 2**20


def check_free_space(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need:
        raise UserError(f"only {free / 2**20:,.0f} MiB are free in {where}, and the {what} needs about "
                        f"{need / 2**20:,.0f} MiB", "output.dir",
                        "Free some space (the last checkpoint is kept) and run the same command again to resume.")


AGAIN = "run the same command again to resume (the last checkpoint is kept)"  # after a full disk in a run


def save_checkpoint(run_dir: Path, model, optimizer, scheduler, step: int, keep: int,
                    rng: Optional[dict] = None, extra: Optional[dict] = None) -> Path:
    """Adapter + optimizer + scheduler + RNG (``rng``: the states to resume with; default the current ones),
    written to a temporary folder and renamed: never half-written."""
    import torch

    final = rundir.checkpoint_path(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    check_free_space(root, 3 * adapter_bytes(model) + 2**20, "checkpoint")  # weights and Adam's two moments
    state = trainer_state(step, optimizer.state_dict(), scheduler, rng, extra)
    with staged(final) as tmp, no_space_is_a_user_error(final, "output.dir", AGAIN, partial=tmp):
        model.save_pretrained(tmp)
        torch.save(state, tmp / rundir.STATE_FILE)
        follow_umask(tmp)
    for old in rundir.checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _load_weights(ckpt: Path, model) -> None:
    """The checkpoint's adapter into the peft model, or (fully fine-tuned) its model weights into the model."""
    from safetensors.torch import load_file

    if hasattr(model, "get_base_model"):
        from peft import set_peft_model_state_dict

        weights = load_file(str(ckpt / "adapter_model.safetensors"))
        unexpected = getattr(set_peft_model_state_dict(model, weights), "unexpected_keys", [])
        missing: list = []
    else:
        files = sorted(ckpt.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no model weights in {ckpt}")
        weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        result = model.load_state_dict(weights, strict=False)
        unexpected = result.unexpected_keys
        tied = set(getattr(model, "_tied_weights_keys", None) or ())  # saved once, under the tensor they share
        missing = [k for k in result.missing_keys if k not in tied]
    if unexpected or missing:
        raise UserError(f"checkpoint {ckpt} does not match the model ({len(unexpected)} unexpected keys, "
                        f"{len(missing)} missing)", "output.dir", "Use --force to start over.")


def weights_only_refusal(e: pickle.UnpicklingError) -> Optional[str]:
    """Why ``torch.load(weights_only=True)`` refused a file (the global it names, or ""), or None when the error
    is not that refusal (a damaged file)."""
    if not str(e).startswith("Weights only load failed"):
        return None
    return next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "global" in line), "")


def load_data_only(path: Path, ckpt: Path):
    """A torch file of a checkpoint read as data only: tensors, numbers, strings and containers of them
    (``weights_only=True``). delft and transformers write nothing else there, so a file that holds other Python
    objects was made by someone else, and unpickling it could run their code: it is refused, never loaded. A damaged
    file raises as it is (the caller may fall back to an older checkpoint)."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        reason = weights_only_refusal(e)
        if reason is None:
            raise
        raise UserError(f"{path} holds Python objects, not only tensors and numbers ({reason[:160]}); delft never "
                        "writes such a file, and loading it could run code planted in it, so it was not loaded and "
                        "nothing was deleted", "output.dir",
                        f"Resume only runs you made. To resume from an older checkpoint, remove {ckpt} yourself; "
                        "to start over, pass --force.") from None


def check_data_only(ckpt: Path) -> None:
    """Every torch file of a checkpoint written by transformers' Trainer (train.stage grpo), read as data before the
    Trainer reads it: the same refusal as delft's own checkpoints. The numpy RNG state is allowed as transformers
    allows it when it reads the file (its own allowlist), and nothing more."""
    from transformers.trainer_pt_utils import safe_globals

    for path in sorted(ckpt.glob("*.pt")) + sorted(ckpt.glob("*.pth")):
        with safe_globals():
            load_data_only(path, ckpt)


def read_state(ckpt: Path) -> dict:
    """The checkpoint's optimizer, scheduler and RNG states (``load_data_only``)."""
    path = ckpt / rundir.STATE_FILE
    state = load_data_only(path, ckpt)
    if not isinstance(state, dict) or not {"step", "optimizer", "scheduler", "rng"} <= state.keys():
        raise ValueError(f"{path} is not a delft trainer state")  # damaged: the caller tries an older checkpoint
    return state


def load_checkpoint(ckpt: Path, model, optimizer, scheduler, extra: Optional[dict] = None) -> int:
    """Restore ``ckpt`` into the model, optimizer, scheduler and RNGs; ``extra`` gets what the trainer stored beside
    them (early stopping's state). Returns the step."""
    _load_weights(ckpt, model)
    step, stored = restore_trainer_state(read_state(ckpt), scheduler, optimizer)
    if extra is not None:
        extra.update(stored)
    return step
