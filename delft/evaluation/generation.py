"""Greedy decoding: the one generator behind ``delft eval`` and ``delft inspect``.

A plain function over (model, tokenizer, prompts), so training can call it too (held-out exact match).
Prompts are sorted by length so each batch pads little, and padded on the left so every prompt ends at the
same position and the KV cache continues all of them together; only token ids are kept (no scores or
logits), so memory stays flat however many prompts there are. A continuation ends at EOS, at a chat
end-of-turn token, or once its text holds a stop string (past its leading whitespace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from delft.data.batches import prompt_ids
from delft.numbers.answers import CHAT_STOP_STRINGS, PLAIN_STOP_STRINGS, cut_at_stop


@dataclass
class Generation:
    """One greedy continuation."""

    ids: list[int]  # the generated tokens before EOS / end-of-turn
    answer_ids: list[int]  # ``ids`` before the token that completes the first stop string
    text: str  # ``ids`` decoded, special tokens dropped
    answer: str  # ``text`` cut at the first stop string: what eval extracts from and inspect shows


def stop_strings(tokenizer, chat: bool) -> list[str]:
    """Where an answer ends: the end-of-turn markers for chat prompts, a blank line or a new problem otherwise."""
    stops = list(CHAT_STOP_STRINGS if chat else PLAIN_STOP_STRINGS)
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos and eos not in stops:
        stops.append(eos)
    return stops


def eos_ids(model, tokenizer, chat: bool) -> list[int]:
    """The model's and the tokenizer's EOS ids, plus (chat) the end-of-turn tokens some templates use besides."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        for i in (source if isinstance(source, (list, tuple)) else [source]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if chat:
        vocab = tokenizer.get_vocab()
        for s in CHAT_STOP_STRINGS:
            if s in vocab and vocab[s] not in ids and s in getattr(tokenizer, "all_special_tokens", []):
                ids.append(vocab[s])
    return ids


def _has_stop(tokenizer, ids: Sequence[int], stops: Sequence[str]) -> bool:
    # Special tokens stay in the text here, so a special end-of-turn marker that is not an EOS id stops too.
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return cut_at_stop(text, stops) != text


class _StopOnStrings:
    """Per-sequence stopping once a row's generated text holds a stop string."""

    def __init__(self, tokenizer, prompt_len: int, stops: Sequence[str]):
        self.tokenizer, self.prompt_len, self.stops = tokenizer, prompt_len, list(stops)

    def __call__(self, input_ids, scores=None, **kwargs):
        import torch

        done = [_has_stop(self.tokenizer, row, self.stops) for row in input_ids[:, self.prompt_len:].tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _before_stop(tokenizer, ids: list[int], stops: Sequence[str]) -> list[int]:
    """``ids`` before the token whose decoding first holds a stop string (all of them when none does)."""
    if not stops or not _has_stop(tokenizer, ids, stops):
        return ids
    k = next(k for k in range(1, len(ids) + 1) if _has_stop(tokenizer, ids[:k], stops))
    return ids[: k - 1]


def _left_padded(encoded: Sequence[list[int]], pad_id: int):
    """(input ids, attention mask) with every row ending at the last column."""
    import torch

    width = max(len(seq) for seq in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, seq in enumerate(encoded):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
    return ids, mask


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding: ``k`` answers per prompt at ``temperature`` with nucleus ``top_p``, seeded."""

    k: int
    temperature: float
    top_p: float = 1.0
    seed: int = 0


def greedy(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, chat: bool = False,
           batch_size: int = 8, stops: Optional[Sequence[str]] = None, eos: Optional[Sequence[int]] = None,
           on_batch: Optional[Callable[[int], None]] = None) -> list[Generation]:
    """Greedy continuations of ``prompts`` (rendered prompt texts), in the order given.

    ``stops`` and ``eos`` default to :func:`stop_strings` and :func:`eos_ids` for the template (``chat``);
    ``on_batch(n)`` is called after each batch of ``n`` prompts (progress bars).
    """
    return [g[0] for g in generate(model, tokenizer, prompts, max_new_tokens, chat, batch_size, stops, eos, on_batch)]


def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, chat: bool = False,
             batch_size: int = 8, stops: Optional[Sequence[str]] = None, eos: Optional[Sequence[int]] = None,
             on_batch: Optional[Callable[[int], None]] = None,
             sampling: Optional[Sampling] = None) -> list[list[Generation]]:
    """Continuations of ``prompts``, in the order given: one greedy each, or ``sampling.k`` sampled ones.

    Sampling seeds torch's generator once per batch (seed + the batch's first position in length order) inside a
    forked RNG state, so the same seed, batch size and prompts give the same samples, whatever ran before, and
    the caller's random state is left as it was."""
    import torch

    stops = stop_strings(tokenizer, chat) if stops is None else list(stops)
    eos = eos_ids(model, tokenizer, chat) if eos is None else list(eos)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    gen_cfg = _generation_config(max_new_tokens, pad_id, eos, sampling)
    k = sampling.k if sampling else 1
    out: list[list[Generation]] = [[] for _ in prompts]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for start in range(0, len(order), batch_size):
            idx = order[start: start + batch_size]
            if sampling is not None:
                torch.manual_seed(sampling.seed + start)
            rows = _generate_batch(model, tokenizer, [encoded[i] for i in idx], pad_id, gen_cfg, stops, device)
            for row, i in enumerate(idx):
                out[i] = [_finish(tokenizer, new, eos, stops) for new in rows[row * k:(row + 1) * k]]
            if on_batch is not None:
                on_batch(len(idx))
    return out


def _generation_config(max_new_tokens: int, pad_id: int, eos: Sequence[int], sampling: Optional[Sampling]):
    from transformers import GenerationConfig

    common = dict(max_new_tokens=max_new_tokens, num_beams=1, pad_token_id=pad_id, eos_token_id=list(eos) or None,
                  use_cache=True, output_scores=False, output_logits=False, return_dict_in_generate=False)
    if sampling is None:
        return GenerationConfig(do_sample=False, **common)
    # top_k=0: no top-k cut (transformers' default is 50), so top_p alone shapes the distribution
    return GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                            num_return_sequences=sampling.k, **common)


def _generate_batch(model, tokenizer, encoded: Sequence[list[int]], pad_id: int, gen_cfg, stops, device):
    """The new token ids of every returned sequence of one batch (num_return_sequences rows per prompt)."""
    import torch
    from transformers import StoppingCriteriaList

    ids, mask = _left_padded(encoded, pad_id)
    width = ids.shape[1]
    criteria = StoppingCriteriaList([_StopOnStrings(tokenizer, width, stops)]) if stops else None
    with torch.inference_mode():
        result = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                generation_config=gen_cfg, stopping_criteria=criteria)
    return [row[width:].tolist() for row in result]


def _finish(tokenizer, new: list[int], eos: Sequence[int], stops: Sequence[str]) -> Generation:
    """One continuation cut at its first EOS, decoded, and cut at its first stop string."""
    new = new[: next((k for k, t in enumerate(new) if t in eos), len(new))]
    text = tokenizer.decode(new, skip_special_tokens=True)
    return Generation(new, _before_stop(tokenizer, new, stops), text, cut_at_stop(text, stops))
