"""A model's context: refuse, before generating, a prompt and an answer budget that do not fit in it.

Past ``max_position_embeddings`` a model runs on out of its positions: a rotary model attends over the whole
prompt in one call and generates for minutes, printing nothing, then answers from positions it never saw.
``delft inspect`` (one prompt) and ``delft eval`` (every problem's prompt, few-shot prompts included) call the
same check. Training checks data.max_length against the same number, read from the model folder's config.json
before any weights load (``delft recipe check`` reads it too, for a local folder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from delft.errors import UserError
from delft.rundir import MODEL_CONFIG

# Where a config.json gives the context: most models, GPT-2's own name, and a multimodal model's text_config.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions")
CONFIG_READ_LIMIT = 16 * 2**20  # a config.json is a few KiB; a larger one is load's to judge, not this check's


def context_limit(model) -> Optional[int]:
    """The model's context in tokens (max_position_embeddings in its config); None where the config has none."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    return limit


def check_context(model, n_prompt: int, n_answer: int, name: str, where: str, prompt: str = "the prompt",
                  budget: Optional[str] = "--max-new-tokens", lower: str = "pass --max-new-tokens {n} or fewer",
                  shorten: Optional[str] = None) -> None:
    """Refuse when ``n_prompt`` tokens of ``prompt`` and ``n_answer`` new tokens pass ``name``'s context.

    ``budget`` names the setting that gives ``n_answer`` (``--max-new-tokens``, ``eval.max_new_tokens``); None when
    the answer is fixed (inspect's ``--target``); ``lower`` says how to give a smaller one. ``shorten`` replaces
    "Shorten the prompt to N tokens or fewer" where the caller knows a better way (fewer few-shot exemplars)."""
    limit = context_limit(model)
    if limit is None or n_prompt + n_answer <= limit:
        return
    answer = f"the --target answer is {n_answer}" if budget is None else f"{budget} is {n_answer}"
    fits, room = limit - n_answer, limit - n_prompt  # the longest prompt, the most new tokens, that fit
    told = shorten is not None  # the caller's way to shorten already counts the budget
    if shorten is None:
        shorten = f"Shorten the prompt to {fits} tokens or fewer" if fits >= 1 else "Give a shorter prompt"
    if budget is None:
        fix = f"{shorten}." if fits >= 1 else f"{shorten}, and a shorter --target."
    elif room < 1 and told:
        fix = f"{shorten}."
    elif room < 1:
        fix = f"{shorten}, so that it and {budget} together stay within {limit} tokens."
    elif fits < 1:
        fix = lower.format(n=room)[:1].upper() + lower.format(n=room)[1:] + "."
    else:
        fix = f"{shorten}, or {lower.format(n=room)}."
    raise UserError(f"{prompt} is {n_prompt} tokens and {answer}: {n_prompt + n_answer} tokens, more than {name}'s "
                    f"context of {limit} tokens (max_position_embeddings in its config); nothing was generated",
                    where, fix)


def config_context(model_dir: Path) -> Optional[int]:
    """The context a local model folder's config.json gives (CONTEXT_KEYS, then its text_config's), read as JSON
    alone: no torch, nothing downloaded. None where the file, the key or a usable value is missing (a damaged
    config is the loader's to report, by name)."""
    file = Path(model_dir) / MODEL_CONFIG
    try:
        if file.stat().st_size > CONFIG_READ_LIMIT:
            return None
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    sections = [config, config.get("text_config")] if isinstance(config, dict) else []
    for section in sections:
        for key in CONTEXT_KEYS if isinstance(section, dict) else ():
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def check_max_length(max_length: int, model_dir: Path, name: str) -> None:
    """Refuse a data.max_length longer than the context in the model folder's config.json (a from-scratch model's
    own context is checked by the recipe schema)."""
    limit = config_context(model_dir)
    if limit is not None:
        _check_fits(max_length, limit, name, f"max_position_embeddings in {Path(model_dir) / MODEL_CONFIG}")


def check_model_max_length(max_length: int, model, name: str) -> None:
    """The same for a loaded model (one from the hub, whose config.json was not here before it loaded)."""
    limit = context_limit(model)
    if limit is not None:
        _check_fits(max_length, limit, name, "max_position_embeddings in its config")


def _check_fits(max_length: int, limit: int, name: str, source: str) -> None:
    if max_length > limit:
        raise UserError(f"data.max_length {max_length} is longer than {name}'s context of {limit} tokens ({source}): "
                        "an example that long would run past the positions the model has", "data.max_length",
                        f"Set data.max_length to {limit} or less.")
