"""delft's GRPO trainer for library use: TRL's ``GRPOTrainer`` plus the auxiliary digit term on the gold solutions
(delft.training.grpo_trainer, where it lives because ``delft train``'s GRPO stage runs it), the numeric rewards
as TRL reward functions (delft.numbers.rewards), and ``add_gold_columns``, which gives a dataset of TRL's
``prompt`` / ``completion`` rows the gold token ids the auxiliary term reads.

    from delft.integrations.grpo import DigitGRPOTrainer, add_gold_columns, exact_reward, digit_reward
"""

from __future__ import annotations

from typing import Any, Optional

from delft.errors import UserError
from delft.numbers.rewards import digit_reward, exact_reward
from delft.numbers.tokens import IGNORE
from delft.training.grpo_trainer import GOLD_COLUMNS, DigitGRPOTrainer, mu_at

__all__ = ["DigitGRPOTrainer", "add_gold_columns", "digit_reward", "exact_reward", "gold_ids", "mu_at"]


def _pair_text(tokenizer, prompt: Any, completion: Any) -> tuple[Any, str]:
    """(the prompt as TRL tokenises it: its text, or its messages; the completion's text up to the end of turn)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion + (tokenizer.eos_token or "")
    if isinstance(prompt, list) and isinstance(completion, list):
        shown = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if not full.startswith(shown):
            raise UserError("the chat template does not render the prompt's messages as the start of the whole "
                            "conversation, so the completion's tokens cannot be told from the prompt's",
                            fix="Use a tokenizer whose chat template renders a conversation prefix-stable.")
        return prompt, full[len(shown):]
    raise UserError(f"a row's prompt and completion are {type(prompt).__name__} and {type(completion).__name__}: "
                    "add_gold_columns takes TRL's standard (two strings) or conversational (two lists of messages) "
                    "prompt-completion rows", fix="Give both columns in one of the two forms.")


def gold_ids(tokenizer, prompt: Any, completion: Any, max_length: Optional[int] = None) -> dict:
    """``{"gold_input_ids", "gold_labels"}`` of one row: the prompt tokenised as TRL's GRPOTrainer tokenises it
    (the tokenizer's call on a string, the chat template with the generation prompt on messages), then the
    completion with its end of turn; the prompt's labels -100, both cut to ``max_length`` tokens."""
    prompt, completion = _pair_text(tokenizer, prompt, completion)
    if isinstance(prompt, str):
        p_ids = list(tokenizer(text=prompt)["input_ids"])
    else:
        p_ids = list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"])
    c_ids = tokenizer.encode(completion, add_special_tokens=False)
    ids, labels = p_ids + c_ids, [IGNORE] * len(p_ids) + list(c_ids)
    end = len(ids) if max_length is None else max_length
    return {GOLD_COLUMNS[0]: ids[:end], GOLD_COLUMNS[1]: labels[:end]}


def add_gold_columns(dataset, tokenizer, max_length: Optional[int] = None, prompt_column: str = "prompt",
                     completion_column: str = "completion"):
    """``dataset`` (a datasets ``Dataset`` or ``IterableDataset`` of prompt/completion rows) with the columns
    ``gold_input_ids`` and ``gold_labels`` that DigitGRPOTrainer's auxiliary term trains on (``gold_ids``)."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        missing = [c for c in (prompt_column, completion_column) if c not in columns]
        if missing:
            raise UserError(f"add_gold_columns reads the columns {prompt_column!r} and {completion_column!r}; the "
                            f"dataset has no {', '.join(map(repr, missing))} (its columns: {', '.join(columns)})",
                            fix="Name the columns that hold them: add_gold_columns(ds, tok, prompt_column=..., "
                            "completion_column=...).")
    return dataset.map(lambda row: gold_ids(tokenizer, row[prompt_column], row[completion_column], max_length))
