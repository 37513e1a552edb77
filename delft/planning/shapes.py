"""A model's shape from its config.json alone, no weights loaded: layers, widths, vocabulary, linear layers and
parameter counts; where the config is read from (a local directory, the hub cache, a from-scratch recipe) and the
number tokens a run adds to it."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from delft.errors import UserError
from delft.models.scratch import CHAR_VOCAB_SIZE
from delft.models.sources import SMOLLM2_ALIAS, cache_dir, gguf_cache_path, resolve_model
from delft.numbers.tokens import NumberVocab
from delft.rundir import read_json

# SmolLM2-135M-Instruct's shape, so the alias plans without fetching anything.
SMOLLM2_CONFIG = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                      tie_word_embeddings=True)


# The shapes of common families, copied from their config.json (--shape NAME plans one without a config.json).
SHAPES_FILE = Path(__file__).with_name("shapes.json")


def shipped_shapes() -> dict[str, dict]:
    """The shipped shapes by name: {hub_id, number_tokens, config}."""
    data = json.loads(SHAPES_FILE.read_text(encoding="utf-8"))
    return {name: entry for name, entry in data.items() if not name.startswith("_")}


# The models measured on one H200 (docs/gpu.md, "chunked CE + 10-row digit term" rows): torch max allocated.
QWEN2 = {size: shipped_shapes()[f"qwen2.5-{size}"]["config"] for size in ("0.5b", "1.5b", "7b")}


LORA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# config key under which run_plan passes the tokenizer's number-token count (delft.numbers.tokens); 10 when unknown
NUMBER_TOKENS = "delft_number_tokens"


def model_shape(config: dict) -> dict:
    """The numbers the estimate needs, from a config.json dict (nested text_config and GPT-style names too)."""
    cfg = config
    if "hidden_size" not in cfg and "n_embd" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                   cfg["text_config"].get("tie_word_embeddings"))}

    def get(*names, default=None):
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        return default

    H = get("hidden_size", "n_embd", "d_model")
    L = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    V = get("vocab_size")
    if not all(isinstance(x, int) and x > 0 for x in (H, L, heads, V)):
        raise UserError("the model's config.json lacks hidden_size / num_hidden_layers / num_attention_heads / "
                        "vocab_size", "model.name", "--plan supports decoder-only transformer configs.")
    kv = get("num_key_value_heads", "n_head_kv", default=heads)
    head_dim = get("head_dim", default=H // heads)
    inter = get("intermediate_size", "n_inner", "ffn_dim", default=4 * H)
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=1) or 1
    return dict(model_type=cfg.get("model_type", "?"), hidden=H, layers=L, heads=heads, kv_heads=kv,
                head_dim=head_dim, intermediate=inter, vocab=V, experts=int(experts),
                tied=bool(get("tie_word_embeddings", default=False)),
                number_tokens=int(config.get(NUMBER_TOKENS, 10)),
                qkv_bias=bool(get("attention_bias", default=cfg.get("model_type") == "qwen2")))


def linear_shapes(s: dict) -> dict:
    """(in, out) of each projection of one layer."""
    H, I = s["hidden"], s["intermediate"]  # noqa: E741 - the shape's names
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}


def lora_targets(target_modules) -> tuple[str, ...]:
    if target_modules == "all-linear":
        return LORA_NAMES
    names = tuple(n for n in LORA_NAMES if any(t == n or t.endswith("." + n) for t in target_modules))
    return names or LORA_NAMES  # unknown names (other architectures): count as if all projections


def parameter_counts(s: dict) -> tuple[int, int]:
    """(parameters in the linear projections, all the others: embeddings, output layer, norms, qkv biases) of a
    ``model_shape``."""
    H, L, V = s["hidden"], s["layers"], s["vocab"]
    lin = linear_shapes(s)
    mlp = sum(a * b for k, (a, b) in lin.items() if k.endswith(("gate_proj", "up_proj", "down_proj")))
    linear_params = L * (sum(a * b for a, b in lin.values()) + (s["experts"] - 1) * mlp)
    other_params = V * H * (1 if s["tied"] else 2) + L * 2 * H + H
    if s["qkv_bias"]:
        other_params += L * (lin["q_proj"][1] + 2 * lin["k_proj"][1])
    return linear_params, other_params


def read_model_config(recipe) -> tuple[dict, str]:
    """(config.json as a dict, where it came from) without loading or downloading weights."""
    name = recipe.model.name
    if recipe.model.init == "scratch":
        return scratch_config(recipe)
    if name == SMOLLM2_ALIAS:
        path = cache_dir() / SMOLLM2_ALIAS / "config.json"
        if path.is_file():
            return _config(path), str(path)
        return dict(SMOLLM2_CONFIG), "built-in shape of SmolLM2-135M-Instruct"
    if name.endswith(".gguf"):
        p = Path(name).expanduser()
        if p.is_file():  # the directory delft.models.sources.gguf_to_cache converts it into
            conv = gguf_cache_path(p) / "config.json"
            if conv.is_file():
                return _config(conv), str(conv)
        raise UserError(f"--plan needs a config.json; {name} has not been converted yet", "model.name",
                        "Run `delft train` once on a CPU (it converts the GGUF file) or point model.name at a "
                        "model directory.")
    ref = resolve_model(name, recipe.model.revision)
    if ref.is_local:
        return _config(Path(ref.path) / "config.json"), str(Path(ref.path) / "config.json")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "config.json", revision=recipe.model.revision)
    except Exception as e:  # noqa: BLE001 - network and hub errors come in many types
        raise UserError(f"could not fetch config.json of {name!r}: {str(e).splitlines()[0][:200]}", "model.name",
                        "Download the model directory where there is network and point model.name at it.") from None
    return _config(Path(path)), f"{name} (config.json from the hub)"


def shipped_shape(name: str) -> tuple[dict, str, str]:
    """(config with its number-token count, where it came from, the hub id it is the shape of) of a shipped
    shape; an unknown name is refused with the names there are."""
    shapes = shipped_shapes()
    entry = shapes.get(name.strip().lower())
    if entry is None:
        close = difflib.get_close_matches(name.strip().lower(), list(shapes), n=1)
        raise UserError(f"delft ships no shape {name!r}{f' (did you mean {close[0]}?)' if close else ''}; it ships "
                        f"{', '.join(shapes)}", "--shape", "Give one of those names, or plan from the model's own "
                        "config.json: point model.name at a directory that holds it (nothing else is needed).")
    return ({**entry["config"], NUMBER_TOKENS: entry["number_tokens"]},
            f"delft's shipped shape {name.strip().lower()} (from {entry['hub_id']}'s config.json)", entry["hub_id"])


def scratch_config(recipe) -> tuple[dict, str]:
    """The config.json a scratch recipe's init will have (delft.models.scratch.llama_config), without torch."""
    a = recipe.model.architecture
    if recipe.model.tokenizer == "char":
        vocab, where = CHAR_VOCAB_SIZE, "delft's character-level tokenizer"
    else:
        vocab = _config(Path(resolve_model(recipe.model.tokenizer).path) / "config.json")["vocab_size"]
        where = f"the vocabulary of {recipe.model.tokenizer}"
    return ({"model_type": "llama", "hidden_size": a.hidden_size, "num_hidden_layers": a.layers,
             "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads or a.heads,
             "intermediate_size": a.intermediate_size, "vocab_size": vocab, "tie_word_embeddings": a.tie_embeddings,
             "max_position_embeddings": a.context}, f"model.architecture (init: scratch) with {where}")


def _config(path: Path) -> dict:
    return read_json(path, "model.name", "Restore or download the model again.")


def with_number_tokens(config: dict, source: str) -> tuple[dict, str]:
    """(config with its tokenizer's number-token count under NUMBER_TOKENS, a note saying where it came from).

    The count comes from the tokenizer.json beside config.json (delft.numbers.tokens, without torch); without one,
    from a NUMBER_TOKENS key the user wrote into the config (planning offline from a config.json alone); else 10
    (single digits), also where the tokenizer is refused (then `delft train` refuses it too)."""
    path = Path(source).with_name("tokenizer.json") if Path(source).is_file() else None
    if path is None or not path.is_file():
        if isinstance(config.get(NUMBER_TOKENS), int) and config[NUMBER_TOKENS] > 0:  # written by the user
            return config, f"number tokens: {config[NUMBER_TOKENS]:,}, from {NUMBER_TOKENS} in the config"
        return config, (f"number tokens: no tokenizer.json beside the config, so single digits (10 rows) are assumed "
                        f"(Llama-3: copy its tokenizer.json there, or add \"{NUMBER_TOKENS}\": 1110 to the config)")
    try:
        count = len(NumberVocab.from_tokenizer_file(path).ids)
    except UserError as e:
        return config, f"number tokens: 10 rows assumed; {e.what}"
    return {**config, NUMBER_TOKENS: count}, ""
