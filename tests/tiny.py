"""Tiny random-init models and tokenizers built in the tests (nothing downloaded)."""

from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(chunked_digits: bool = False, chat_template: bool = True, glued_digits: bool = False):
    """A character-level fast tokenizer: every printable ASCII character is one token ('0'..'9' included).

    ``chunked_digits=True`` adds merges so that numbers become multi-digit tokens (Llama-3 style);
    ``glued_digits=True`` merges a space with the next digit (" 7"), as GPT-2 glues digits to other characters.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    merges = []
    if chunked_digits:
        for a in "0123456789":
            for b in "0123456789":
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    if glued_digits:
        for d in "0123456789":
            vocab[" " + d] = len(vocab)
            merges.append((" ", d))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer, hidden: int = 32, layers: int = 2, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        initializer_range=0.2,  # the default 0.02 makes logits ~0.1: nothing for a few LoRA steps to move
    )
    return LlamaForCausalLM(config)


def save_tiny(path: Path, **kwargs) -> Path:
    """Write a tiny model + tokenizer directory that delft loads like any local model."""
    tok = build_tokenizer(**{k: v for k, v in kwargs.items() if k in ("chunked_digits", "chat_template", "glued_digits")})
    model = build_model(tok, **{k: v for k, v in kwargs.items() if k in ("hidden", "layers", "seed")})
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_digit_model(path: Path, hidden: int = 32, seed: int = 0) -> Path:
    """A tiny model whose output layer only ever picks a digit or '.', so every greedy answer holds a number."""
    import torch

    tok = build_tokenizer()
    model = build_model(tok, hidden=hidden, seed=seed)
    allowed = [tok.convert_tokens_to_ids(c) for c in "0123456789."]
    with torch.no_grad():
        w = model.lm_head.weight
        keep = w[allowed].clone() * 20
        w.zero_()
        w[allowed] = keep
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
