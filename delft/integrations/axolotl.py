"""delft's digit losses in axolotl (0.19): ``DigitLossPlugin``, a ``BasePlugin``.

    plugins:
      - delft.integrations.axolotl.DigitLossPlugin
    digit_loss:
      type: del_prob
      weight: 0.3

The ``digit_loss:`` block takes delft's ``loss:`` recipe keys (type, weight, normalisation, place_weights,
place_weight_cap, tau) and is validated with axolotl's config (``DigitLossArgs``: unknown keys refused). With the
block set, the trainer is ``DigitLossMixin`` + axolotl's ``AxolotlTrainer`` (delft.integrations.hf: CE + weight x
the digit term, normalised over the whole optimizer batch), and after axolotl creates it the block configures its
loss. Without the block axolotl trains as it would. Only axolotl imports this module.
"""

from __future__ import annotations

import functools
from typing import Literal, Optional

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, Field

from delft.integrations.hf import DigitLossMixin
from delft.losses.misuse import callers_words
from delft.losses.registry import LOSS_KINDS, LOSS_TYPES
from delft.recipe.schema import LossConfig, NumbersConfig

_TYPE_PARAMS = {p for t in LOSS_TYPES.values() for p in t.params}  # options only some types take (dist2's tau)


class DigitLossConfig(LossConfig):
    """delft's ``loss:`` keys; the type defaults to del_prob, as DigitLossMixin's does."""

    type: Literal[tuple(LOSS_TYPES)] = Field(  # type: ignore[valid-type]
        "del_prob", description=f"The loss: {LOSS_KINDS} (docs/losses.md).")
    numbers: Optional[NumbersConfig] = Field(
        None, description="The form the data writes numbers in (order, count_prefix, as data.numbers), so each digit "
        "is read at its true place (docs/number_formats.md).")


class DigitLossArgs(BaseModel):
    """The plugin's input args, merged into axolotl's config schema."""

    digit_loss: DigitLossConfig | None = Field(
        None, description="delft's digit loss (CE + weight x digit term); unset: axolotl's own loss.")


def loss_options(block) -> dict:
    """The ``digit_loss:`` block (a dict, or axolotl's dump of it) validated, as ``configure_digit_loss`` options:
    a type's own parameters only for that type (the dump carries every field's default)."""
    config = block if isinstance(block, DigitLossConfig) else DigitLossConfig.model_validate(dict(block))
    own = LOSS_TYPES[config.type].params
    out = {k: v for k, v in config.model_dump(exclude={"numbers"}).items() if k not in _TYPE_PARAMS or k in own}
    return out if config.numbers is None else {**out, "numbers": config.numbers}


@functools.cache
def digit_axolotl_trainer() -> type:
    """``DigitLossMixin`` + axolotl's ``AxolotlTrainer``, built on first use (that import needs axolotl's stack)."""
    try:
        from axolotl.core.trainers.base import AxolotlTrainer
    except ImportError as exc:
        raise ImportError(f"DigitLossPlugin could not import axolotl's trainer "
                          f"(axolotl.core.trainers.base.AxolotlTrainer): {exc}; install axolotl with its "
                          "dependencies (pip install axolotl)", name=exc.name) from exc

    class DigitAxolotlTrainer(DigitLossMixin, AxolotlTrainer):
        """axolotl's causal trainer with delft's CE + weight x digit term."""

    return DigitAxolotlTrainer


class DigitLossPlugin(BasePlugin):
    """axolotl plugin: the ``digit_loss:`` block selects and configures delft's digit-loss trainer."""

    def get_input_args(self) -> str:
        return "delft.integrations.axolotl.DigitLossArgs"

    def get_trainer_cls(self, cfg):
        if cfg.digit_loss is None:
            return None
        if cfg.rl:
            raise ValueError(f"digit_loss applies to supervised fine-tuning, not to rl: {cfg.rl}")
        return digit_axolotl_trainer()

    def post_trainer_create(self, cfg, trainer) -> None:
        if cfg.digit_loss is None:
            return
        if not callable(getattr(trainer, "configure_digit_loss", None)):
            raise TypeError(f"digit_loss is set but the trainer is {type(trainer).__name__}, not a DigitLossMixin: "
                            "another plugin's get_trainer_cls came first (list DigitLossPlugin first in plugins:, "
                            "or drop the other trainer)")
        with callers_words("set type: ce under digit_loss: in the axolotl config (CE alone), or drop the block"):
            trainer.configure_digit_loss(loss_options(cfg.digit_loss), tokenizer=trainer.processing_class)
