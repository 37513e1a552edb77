"""The digit-loss options library callers pass (``digit_loss=`` of DigitTrainer, DigitSFTTrainer and
DigitGRPOTrainer, GRPO's ``aux_mu``), checked with the recipe's own ``loss:`` schema (recipe.LossConfig) and refused
in the caller's words; and the settings a checkpoint was trained with (``digit_loss.json`` in the checkpoint
folder), compared when a run resumes from it, so a script that forgot its ``digit_loss`` does not continue silently
with another loss.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from delft.errors import UserError
from delft.losses.registry import LOSS_TYPES
from delft.outputs import write_atomic
from delft.recipe.schema import LossConfig, describe_error

SETTINGS_FILE = "digit_loss.json"
RESUME_MISMATCH = ("refuse", "allow")  # digit_loss_resume_mismatch: what a resume with other settings does
_TYPE_PARAMS = {p for t in LOSS_TYPES.values() for p in t.params}  # options only some types take (dist2's tau)
_EXAMPLE = "{'type': 'del_prob', 'weight': 0.3}"


class DigitLossValueError(UserError, ValueError):
    """A digit-loss option a library caller passed is wrong (a ValueError, so ``except ValueError`` catches it)."""


class DigitLossTypeError(UserError, TypeError):
    """A digit-loss option a library caller passed has the wrong shape (a TypeError as well)."""


def digit_loss_options(value: Any, default_type: str = "del_prob", name: str = "digit_loss",
                       key_prefix: str = "", shown: Optional[str] = None) -> dict:
    """``value`` (None, a type name, or a dict of delft's ``loss:`` keys) as the full options DigitLoss takes:
    type, weight (the type's default when unset), normalisation, place weights, and the type's own parameters.
    A negative or non-finite weight, an unknown type and an unknown key (with a did-you-mean) are refused naming
    ``name`` as the caller wrote it (or ``shown``); ``key_prefix`` spells the keys as the caller does."""
    shown = shown or f"{name}={value!r}"  # as the caller wrote it
    if value is None:
        value = {}
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, Mapping):
        raise DigitLossTypeError(
            f"{name}={value!r} is a {type(value).__name__}; it takes a dict of delft's loss keys ({name}={_EXAMPLE}) "
            f"or a loss type's name ({name}='del_prob')",
            fix=f"Pass one of the two; the types: {', '.join(LOSS_TYPES)}.")
    try:
        config = LossConfig.model_validate({"type": default_type, **value})
    except ValidationError as exc:
        problems = "; ".join(key_prefix + describe_error(err, LossConfig).removeprefix("(top level): ")
                             for err in exc.errors())
        keys = ", ".join(key_prefix + k for k in LossConfig.model_fields)
        raise DigitLossValueError(f"{shown}: {problems}", fix=f"The accepted keys: {keys} "
                                  f"(docs/losses.md); the weight is a finite number >= 0.") from None
    own = LOSS_TYPES[config.type].params
    return {k: v for k, v in config.model_dump().items() if k not in _TYPE_PARAMS or k in own}


def check_mu(**weights: Optional[float]) -> None:
    """Refuse a negative, non-finite or non-numeric auxiliary weight (GRPO's ``aux_mu``, ``aux_mu_end``): the term
    is on only for mu > 0, so a negative one would train silently without it."""
    for name, value in weights.items():
        if value is None and name.endswith("_end"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DigitLossTypeError(f"{name}={value!r} is a {type(value).__name__}, not a number",
                                     fix=f"Pass {name} as a finite number >= 0 (0 turns the auxiliary term off).")
        if not math.isfinite(value) or value < 0:
            raise DigitLossValueError(f"{name}={value!r}: the auxiliary term's weight must be a finite number >= 0",
                                      fix=f"Pass {name} >= 0 (0 turns the auxiliary term off).")


def check_resume_mismatch(value: str, name: str = "digit_loss_resume_mismatch") -> str:
    if value not in RESUME_MISMATCH:
        raise DigitLossValueError(f"{name}={value!r}: choose one of {', '.join(map(repr, RESUME_MISMATCH))}",
                                  fix="'refuse' (the default) stops a resume whose digit loss differs from the "
                                  "checkpoint's; 'allow' changes the loss on purpose.")
    return value


def save_settings(folder: str | os.PathLike, options: dict) -> None:
    """Write ``options`` as ``digit_loss.json`` into the checkpoint ``folder`` (whole or not at all)."""
    write_atomic(Path(folder) / SETTINGS_FILE, json.dumps(options, indent=1, sort_keys=True) + "\n")


def check_resume(checkpoint: Optional[str | os.PathLike], options: dict, mismatch: str = "refuse",
                 name: str = "digit_loss") -> None:
    """Refuse resuming from ``checkpoint`` when its ``digit_loss.json`` differs from ``options``, unless
    ``mismatch`` is 'allow'. A checkpoint without the file (another trainer's) has nothing to compare."""
    if checkpoint is None or mismatch == "allow":
        return
    path = Path(checkpoint) / SETTINGS_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DigitLossValueError(f"{path} (the digit-loss settings of the checkpoint) cannot be read: {exc}",
                                  fix="Pass digit_loss_resume_mismatch='allow' to resume without comparing them, "
                                  "or resume from another checkpoint.") from None
    if saved != options:
        changed = ([k for k in sorted(set(saved) | set(options)) if saved.get(k) != options.get(k)]
                   if isinstance(saved, dict) else [])
        raise DigitLossValueError(
            f"resume_from_checkpoint={str(checkpoint)!r} was trained with {name}={saved!r} ({SETTINGS_FILE}), "
            f"but this trainer has {name}={options!r}" + (f" (differs in {', '.join(changed)})" if changed else ""),
            fix=f"Pass the checkpoint's {name} to continue the same run, or digit_loss_resume_mismatch='allow' to "
            "change the loss on purpose.")
