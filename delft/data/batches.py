"""Token ids and batches: an example tokenized with its labels (prompt positions ignored), cut to the recipe's
length, and collated into padded or packed rows."""

from __future__ import annotations

from dataclasses import dataclass

from delft.data.prompts import render_pair
from delft.data.sources import Example
from delft.numbers.tokens import IGNORE


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a rendered prompt, the same in training, eval and inspect: no special tokens added, except
    a BOS for tokenizers that ask for one (Llama-2 style) when the text lacks it."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


# Characters kept per token of data.max_length before tokenizing: far more than any tokenizer's token holds, so
# cutting there changes no kept token, and a huge line is not tokenized whole only to be truncated.
CHARS_PER_TOKEN_BUDGET = 32


def cut_to_budget(prompt: str, completion: str, max_length: int) -> tuple[str, str, bool]:
    """(prompt, completion, cut?) within max_length * CHARS_PER_TOKEN_BUDGET characters together."""
    budget = max_length * CHARS_PER_TOKEN_BUDGET
    if len(prompt) + len(completion) <= budget:
        return prompt, completion, False
    return prompt[:budget], completion[:max(0, budget - len(prompt))], True


def tokenize_example(example: Example, tokenizer, cfg) -> Tokenized:
    """Prompt and completion are tokenized apart so the mask boundary is exact."""
    prompt, completion, cut = cut_to_budget(*render_pair(example, tokenizer, cfg), cfg.max_length)
    p_ids = prompt_ids(tokenizer, prompt)
    c_ids = tokenizer.encode(completion, add_special_tokens=False)
    ids = p_ids + c_ids
    labels = (list(p_ids) if cfg.train_on_prompt else [IGNORE] * len(p_ids)) + list(c_ids)
    truncated = cut or len(ids) > cfg.max_length
    return Tokenized(ids[: cfg.max_length], labels[: cfg.max_length], truncated)


def collate(items: list[Tokenized], pad_id: int) -> dict:
    """Right-padded batch. Labels stay aligned with input_ids (the loss shifts them)."""
    import torch

    width = max(len(t.input_ids) for t in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, t in enumerate(items):
        n = len(t.input_ids)
        ids[i, :n] = torch.tensor(t.input_ids)
        labels[i, :n] = torch.tensor(t.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def collate_packed(items: list[Tokenized], pad_id: int, row_length: int) -> dict:
    """Examples laid end to end in rows; position ids restart per example so attention stays inside it.

    transformers builds a block-diagonal causal mask from restarting position_ids when no attention_mask is
    given. The first label of every example is masked, so no target and no digit run crosses a boundary.
    """
    import torch

    rows: list[list[Tokenized]] = []
    for t in items:
        if rows and sum(len(x.input_ids) for x in rows[-1]) + len(t.input_ids) <= row_length:
            rows[-1].append(t)
        else:
            rows.append([t])
    width = max(sum(len(x.input_ids) for x in r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        at = 0
        for t in r:
            n = len(t.input_ids)
            ids[i, at:at + n] = torch.tensor(t.input_ids)
            lab = list(t.labels)
            lab[0] = IGNORE
            labels[i, at:at + n] = torch.tensor(lab)
            pos[i, at:at + n] = torch.arange(n)
            at += n
        if at < width:  # padding continues as its own "example"
            pos[i, at:] = torch.arange(width - at)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}
