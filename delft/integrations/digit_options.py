"""The digit-loss options library callers pass (``digit_loss=`` of DigitTrainer, DigitSFTTrainer and
DigitGRPOTrainer, GRPO's ``aux_mu``), checked with the recipe's own ``loss:`` schema (recipe.LossConfig) and refused
in the caller's words, with ``numbers``, the form numbers are written in (recipe.NumbersConfig's order and
count_prefix); the settings a checkpoint was trained with (``digit_loss.json`` in the checkpoint folder), compared
when a run resumes from it, so a script that forgot its ``digit_loss`` does not continue silently with another
loss; and ``DigitConfigFields``, the digit-loss fields of DigitSFTConfig and DigitGRPOConfig, which only the digit
trainers accept.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from delft.errors import UserError
from delft.losses.registry import LOSS_KINDS, LOSS_TYPES
from delft.outputs import write_atomic
from delft.recipe.schema import LossConfig, NumbersConfig, describe_error

SETTINGS_FILE = "digit_loss.json"
RESUME_MISMATCH = ("refuse", "allow")  # digit_loss_resume_mismatch: what a resume with other settings does
_TYPE_PARAMS = {p for t in LOSS_TYPES.values() for p in t.params}  # options only some types take (dist2's tau)
_EXAMPLE = "{'type': 'del_prob', 'weight': 0.3}"
NUMBERS_KEY = "numbers"  # digit_loss's own key beside the loss: keys: the form numbers are written in
FORM_KEYS = ("order", "count_prefix")  # what the loss reads of NumbersConfig (scope is which numbers data rewrites)


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
        raise_not_a_mapping(value, name)
    form = number_form(value.get(NUMBERS_KEY), f"{key_prefix}{NUMBERS_KEY}", shown)
    value = {k: v for k, v in value.items() if k != NUMBERS_KEY}
    try:
        config = LossConfig.model_validate({"type": default_type, **value})
    except ValidationError as exc:
        problems = "; ".join(key_prefix + describe_error(err, LossConfig).removeprefix("(top level): ")
                             for err in exc.errors())
        keys = ", ".join(key_prefix + k for k in (*LossConfig.model_fields, NUMBERS_KEY))
        raise DigitLossValueError(f"{shown}: {problems}", fix=f"The accepted keys: {keys} "
                                  f"(docs/losses.md); the weight is a finite number >= 0.") from None
    own = LOSS_TYPES[config.type].params
    options = {k: v for k, v in config.model_dump().items() if k not in _TYPE_PARAMS or k in own}
    return {**options, NUMBERS_KEY: form} if form else options


def raise_not_a_mapping(value: Any, name: str) -> None:
    raise DigitLossTypeError(
        f"{name}={value!r} is a {type(value).__name__}; it takes a dict of delft's loss keys ({name}={_EXAMPLE}) "
        f"or a loss type's name ({name}='del_prob')",
        fix=f"Pass one of the two; the types: {', '.join(LOSS_TYPES)}.")


def number_form(value: Any, name: str, shown: str) -> Optional[dict]:
    """The ``numbers`` of a ``digit_loss`` (None, a dict or a NumbersConfig) as ``{"order", "count_prefix"}``, or
    None for natural numbers (so a natural run's digit_loss.json has no such key, as before there was one)."""
    if value is None:
        return None
    if isinstance(value, NumbersConfig):  # its scope says which numbers the data rewrote; the loss reads them all
        value = {k: getattr(value, k) for k in FORM_KEYS}
    if not isinstance(value, Mapping):
        raise DigitLossTypeError(f"{shown}: {name} is a {type(value).__name__}; it takes a dict like "
                                 "{'order': 'reversed', 'count_prefix': True}",
                                 fix="Pass the form your data writes its numbers in (docs/number_formats.md).")
    fix = (f"{name} takes order ('natural' or 'reversed') and count_prefix (True or False), the form of "
           "data.numbers (docs/number_formats.md); every number of the labels is read in it.")
    other = [k for k in value if k not in FORM_KEYS]
    if other:
        raise DigitLossValueError(f"{shown}: {name} has no key {', '.join(map(repr, other))}", fix=fix)
    try:
        form = NumbersConfig.model_validate(dict(value))
    except ValidationError as exc:
        problems = "; ".join(f"{name}." + describe_error(err, NumbersConfig).removeprefix("(top level): ")
                             for err in exc.errors())
        raise DigitLossValueError(f"{shown}: {problems}", fix=fix) from None
    return {k: getattr(form, k) for k in FORM_KEYS} if form.active() else None


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
            f"resume_from_checkpoint={str(checkpoint)!r} was trained with {name} {saved!r} ({SETTINGS_FILE}), "
            f"but this trainer has {name} {options!r}" + (f" (differs in {', '.join(changed)})" if changed else ""),
            fix=f"Pass the checkpoint's {name} to continue the same run, or digit_loss_resume_mismatch='allow' to "
            "change the loss on purpose.")


# ---------------------------------------------------------------------- the digit-loss fields of TRL's configs

_KEYS = ("type", "weight", "normalisation", "place_weights", "place_weight_cap", "tau")  # digit_loss_<key> fields
_DEFAULTS = {**{k: LossConfig.model_fields[k].default for k in _KEYS}, "type": "del_prob"}
_ORDERS = list(NumbersConfig.model_fields["order"].annotation.__args__)


def _field(key: str, help: str, **meta):
    return field(default=_DEFAULTS[key], metadata={"help": help, **meta})


def _choices(key: str) -> list:
    return list(LossConfig.model_fields[key].annotation.__args__)


@dataclass
class DigitLossFields:
    """The digit loss as fields of a TRL config (put first: ``class DigitSFTConfig(DigitLossFields, SFTConfig)``),
    so TRL's config files and ``TrlParser`` command lines choose it. Only the digit trainer the config is made for
    reads them: any other trainer built with such a config is refused (``get_process_log_level``, which
    transformers' ``Trainer.__init__`` calls on its args first), since it would train without the digit loss."""

    digit_loss_type: str = _field("type", f"delft's loss: {LOSS_KINDS} (docs/losses.md).",
                                  choices=list(LOSS_TYPES))
    digit_loss_weight: Optional[float] = _field("weight", "lambda in CE + lambda x the digit term (>= 0); unset: "
                                                "the type's default.")
    digit_loss_normalisation: str = _field("normalisation", "global: CE per label + lambda x term per digit over the "
                                           "optimizer batch; reference: the DEL authors' per-micro-batch scaling.",
                                           choices=_choices("normalisation"))
    digit_loss_place_weights: str = _field("place_weights", "DEL types: reference (2r for the r-th integer digit), "
                                           "capped (at digit_loss_place_weight_cap), uniform (1).",
                                           choices=_choices("place_weights"))
    digit_loss_place_weight_cap: float = _field("place_weight_cap", "digit_loss_place_weights capped: the largest "
                                                "integer-digit weight.")
    digit_loss_tau: float = _field("tau", "dist2 only: the width of the soft target exp(-(k-y)^2/tau).")
    digit_loss_number_order: str = field(default="natural", metadata={
        "help": "How the data writes its numbers: natural, or reversed (least significant digit first), so each "
        "digit gets its true place.", "choices": _ORDERS})
    digit_loss_count_prefix: bool = field(default=False, metadata={
        "help": "The data wraps each number with its digit count, {n:number} (docs/number_formats.md)."})
    digit_loss_resume_mismatch: str = field(default="refuse", metadata={
        "help": "A resume whose digit loss differs from the checkpoint's digit_loss.json: refuse, or allow it "
        "(changing the loss on purpose).", "choices": list(RESUME_MISMATCH)})

    _digit_trainer = "DigitSFTTrainer"  # the trainer that reads these fields (a class attribute, not a field)
    _digit_trainer_building = False  # set while that trainer's __init__ runs (digit_trainer_building)

    def __post_init__(self):
        super().__post_init__()
        check_resume_mismatch(self.digit_loss_resume_mismatch)
        shown = f"{type(self).__name__}(" + ", ".join(
            f"digit_loss_{k}={v!r}" for k, v in self.digit_loss_dict().items()) + ")"
        digit_loss_options(self.digit_loss_dict(), self._DEFAULT_TYPE, key_prefix="digit_loss_", shown=shown)

    _DEFAULT_TYPE = "del_prob"

    def digit_loss_dict(self) -> dict:
        """The ``digit_loss`` these fields give: the type, every other field set away from its default, and the
        number form when it is not the natural one."""
        values = {k: getattr(self, f"digit_loss_{k}") for k in _KEYS}
        out = {k: v for k, v in values.items() if k == "type" or v != _DEFAULTS[k]}
        if self.digit_loss_number_order != "natural" or self.digit_loss_count_prefix:
            out[NUMBERS_KEY] = {"order": self.digit_loss_number_order, "count_prefix": self.digit_loss_count_prefix}
        return out

    def fields_changed(self) -> bool:
        """Whether any digit_loss_* field (resume mismatch aside) is set away from its default."""
        return self.digit_loss_dict() != {"type": self._DEFAULT_TYPE}

    def get_process_log_level(self):
        if not self._digit_trainer_building:
            raise DigitLossTypeError(
                f"a trainer other than {self._digit_trainer} was given a {type(self).__name__}: its digit_loss_* "
                f"fields are read by delft's {self._digit_trainer} alone, so this trainer would train without the "
                "digit loss, silently",
                fix=f"Build delft.integrations's {self._digit_trainer} with it (the same arguments), or give this "
                f"trainer TRL's own config class for training without the digit loss.")
        return super().get_process_log_level()


def config_digit_loss(config, digit_loss, digit_loss_resume_mismatch, caller: str):
    """(digit_loss, digit_loss_resume_mismatch) a digit trainer uses: ``config``'s digit_loss_* fields when it is a
    DigitLossFields config and ``digit_loss`` is None; both set is refused (set the loss in one place)."""
    if not isinstance(config, DigitLossFields):
        return digit_loss, digit_loss_resume_mismatch or "refuse"
    name = type(config).__name__
    if digit_loss is not None and config.fields_changed():
        raise DigitLossValueError(
            f"{caller} got digit_loss={digit_loss!r} and a {name} whose digit_loss_* fields say "
            f"{config.digit_loss_dict()!r}", fix="Set the digit loss in one place: the config's fields or "
            "digit_loss=.")
    digit_loss = config.digit_loss_dict() if digit_loss is None else digit_loss
    return digit_loss, digit_loss_resume_mismatch or config.digit_loss_resume_mismatch


@contextmanager
def digit_trainer_building(config):
    """While a digit trainer's ``__init__`` runs with ``config`` (a DigitLossFields), the config accepts it."""
    if not isinstance(config, DigitLossFields):
        yield
        return
    config._digit_trainer_building = True
    try:
        yield
    finally:
        del config._digit_trainer_building  # back to the class's False
