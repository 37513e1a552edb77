"""Models trained from nothing (model.init: scratch): delft's character-level tokenizer and a Llama-style decoder
with random weights, written once into delft's cache so that every command loads it like any model directory.

The number-token-loss papers show their effects in this regime (small models, single-digit tokens). The initial
weights are a function of the architecture, the tokenizer and train.seed, so one seed gives one init; a study's
"base" row is that untrained model (a floor, not a pretrained start).
"""

from __future__ import annotations

import hashlib
import json
import string

from delft.models.loading import load_tokenizer
from delft.models.sources import ModelRef, cache_dir, resolve_model
from delft.outputs import follow_umask, staged
from delft.recipe.model_section import CHAR_TOKENIZER
from delft.recipe.schema import Recipe
from delft.rundir import MODEL_CONFIG

SCRATCH_DIR = "scratch"  # under delft's cache: one directory per (architecture, tokenizer, seed)
SCRATCH_VERSION = 1  # part of the cache key: bump when the way an init is built changes
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]  # digits, letters, signs, space, \t, \n
CHAR_VOCAB_SIZE = 3 + len(CHARACTERS)  # pad, eos, unk and the characters
INIT_RANGE = 0.02  # std of the random weights (Llama's default)


def char_tokenizer():
    """A fast tokenizer with one token per printable ASCII character (so every digit is its own token) and pad,
    eos and unk; it saves and loads with transformers like any tokenizer (``AutoTokenizer.from_pretrained``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a word
    core.decoder = decoders.Fuse()  # characters join back without spaces
    core.add_special_tokens([PAD, EOS, UNK])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def scratch_tokenizer(source: str):
    """model.tokenizer: delft's character-level one, or a tokenizer loaded from a source (a directory, hub id or
    alias: the model there is not used)."""
    if source == CHAR_TOKENIZER:
        return char_tokenizer()
    return load_tokenizer(resolve_model(source).path)


def init_key(recipe: Recipe) -> str:
    """What an init depends on: its cache directory's name."""
    m = recipe.model
    spec = {"version": SCRATCH_VERSION, "architecture": m.architecture.model_dump(), "tokenizer": m.tokenizer,
            "seed": recipe.train.seed}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def llama_config(recipe: Recipe, tokenizer):
    from transformers import LlamaConfig

    a = recipe.model.architecture
    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads or a.heads,
        max_position_embeddings=a.context, tie_word_embeddings=a.tie_embeddings, initializer_range=INIT_RANGE,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token else eos,
        eos_token_id=eos)


def scratch_model_ref(recipe: Recipe) -> ModelRef:
    """The recipe's random init as a model directory in delft's cache (built on first use, atomically)."""
    import torch
    from transformers import LlamaForCausalLM

    key = init_key(recipe)
    path = cache_dir() / SCRATCH_DIR / key
    a = recipe.model.architecture
    note = (f"random init (Llama-style, hidden {a.hidden_size}, {a.layers} layers, {a.heads} heads, "
            f"tokenizer {recipe.model.tokenizer}, seed {recipe.train.seed})")
    if not (path / MODEL_CONFIG).is_file():
        tokenizer = scratch_tokenizer(recipe.model.tokenizer)
        with torch.random.fork_rng():
            torch.manual_seed(recipe.train.seed)
            model = LlamaForCausalLM(llama_config(recipe, tokenizer))
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged(path, shared=lambda p: (p / MODEL_CONFIG).is_file()) as tmp:  # ranks may build it at once
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            follow_umask(tmp)
    return ModelRef(f"scratch:{key}", str(path), True, note)


def recipe_model_ref(recipe: Recipe) -> ModelRef:
    """Where the recipe's starting weights are: model.name's, or (init: scratch) its random init."""
    if recipe.model.init == "scratch":
        return scratch_model_ref(recipe)
    return resolve_model(recipe.model.name, recipe.model.revision)


def base_name(recipe: Recipe) -> str:
    """The model a recipe's runs are compared with ("base" in eval, compare and study): model.name, or the
    directory of the random init of init: scratch (train.seed's)."""
    if recipe.model.init == "scratch":
        return scratch_model_ref(recipe).path
    return recipe.model.name
