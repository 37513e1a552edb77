"""A model's context: refuse, before generating, a prompt and an answer budget that do not fit in it.

Past ``max_position_embeddings`` a model runs on out of its positions: a rotary model attends over the whole
prompt in one call and generates for minutes, printing nothing, then answers from positions it never saw.
``delft inspect`` (one prompt) and ``delft eval`` (every problem's prompt, few-shot prompts included) call the
same check.
"""

from __future__ import annotations

from typing import Optional

from delft.errors import UserError


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
