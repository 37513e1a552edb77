"""The numbers in a model directory's ``config.json``, checked before transformers builds the model from them.

transformers takes them as they are: ``rms_norm_eps: NaN`` builds a model whose every output is NaN (the first
step's loss is NaN, which looks like a learning rate too high), ``num_hidden_layers: -1`` builds a model with no
layers (LoRA then finds nothing to adapt). A wrong number is said as what it is, naming the file and the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

from delft.errors import UserError
from delft.rundir import MODEL_CONFIG

# Sizes and counts: whole numbers, 1 or more (unset where transformers allows it, e.g. num_key_value_heads).
POSITIVE_WHOLE = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim", "n_layer", "n_embd",
                  "n_head", "n_positions", "n_inner")
# Epsilons and bases: finite numbers above 0.
POSITIVE = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")


def _numbers(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a JSON object, nested configs (text_config, ...) included."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]


def config_problem(config: dict) -> str | None:
    """What is wrong with a config's numbers (the first such key), or None."""
    for key, value in _numbers(config):
        name = key.rsplit(".", 1)[-1]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and not math.isfinite(value):
            return f"sets {key} to {value}, which is not a finite number"
        if name in POSITIVE_WHOLE and value is not None and not (number and value == int(value) and value >= 1):
            return f"sets {key} to {value!r}; it must be a whole number of 1 or more"
        if name in POSITIVE and value is not None and not (number and value > 0):
            return f"sets {key} to {value!r}; it must be a number above 0"
    return None


def check_config_numbers(model_dir: Path, where: str) -> None:
    """Refuse a model directory whose config.json holds a number no model can have (a JSON config that does not
    parse is check_model_files' to report)."""
    file = Path(model_dir) / MODEL_CONFIG
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return
    if not isinstance(config, dict):
        return
    problem = config_problem(config)
    if problem is not None:
        raise UserError(f"{file} {problem}", where, "Correct that value in config.json (the model's own description "
                        "of its shape, not a recipe setting), or use another model.")
