"""Model code shipped inside a folder (transformers' ``auto_map``): found, named, and never run unless the user asks.

A model or tokenizer directory may name Python files of its own in ``auto_map`` (``config.json``,
``tokenizer_config.json``); transformers imports them when ``trust_remote_code`` is on. delft takes that setting only
from the user's own command line or recipe, never from a run, adapter or model directory someone else made, and says
which code would run when a folder needs it.
"""

from __future__ import annotations

import json
from pathlib import Path

from delft.errors import UserError

# The files whose auto_map transformers reads for a causal LM and its tokenizer.
CODE_MAPS = ("config.json", "tokenizer_config.json")


def _auto_map(path: Path) -> dict:
    """``auto_map`` of one JSON file, {} when the file is absent, unreadable or names no code."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}  # a damaged config is refused by whoever reads it next, with its own message
    found = data.get("auto_map") if isinstance(data, dict) else None
    return found if isinstance(found, dict) else {}


def _module_files(auto_map: dict) -> list[str]:
    """``{"AutoModelForCausalLM": "modeling_x.XForCausalLM"}`` -> ``["modeling_x.py"]``; tokenizers map to pairs,
    and a reference may name another repository (``org/repo--module.Class``)."""
    refs: list[str] = []
    for value in auto_map.values():
        refs.extend(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str))
    files = []
    for ref in refs:
        repo, _, dotted = ref.rpartition("--")
        module = dotted.rsplit(".", 1)[0]
        files.append(f"{repo}:{module}.py" if repo else f"{module}.py")
    return sorted(set(files))


def _has_local_code(directory: Path) -> bool:
    """Whether transformers has classes of its own for the directory's ``model_type`` (then auto_map is ignored)."""
    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return True  # no readable config here: nothing to decide for the model
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def remote_code_files(directory: Path) -> list[str]:
    """The code files ``directory`` names in ``auto_map`` (model and tokenizer), sorted; [] for none."""
    return sorted({f for name in CODE_MAPS for f in _module_files(_auto_map(Path(directory) / name))})


def check_remote_code(directory: Path, name: str, where: str, trusted: bool, origin: str = "") -> list[str]:
    """Refuse a folder that cannot load without running its own code unless ``trusted``; returns the code files it
    names (to be ignored in favour of transformers' own classes) otherwise.

    ``origin`` says where the folder's name came from (e.g. "recorded in RUN/delft_run.json"), so the message tells
    the user that the code comes from someone else's folder.
    """
    directory = Path(directory)
    files = remote_code_files(directory)
    if not files or trusted:
        return files
    needed = not _has_local_code(directory) or _tokenizer_needs_code(directory)
    if needed:
        came = f" ({origin})" if origin else ""
        raise UserError(
            f"the model {name}{came} loads only by running code shipped in its folder: {', '.join(files)} in "
            f"{directory}. delft never takes trust_remote_code from a run, adapter or model folder, because that code "
            "would run with your permissions", where,
            "Read those files first; if you trust them, pass --trust-remote-code on the command line (or set "
            "model.trust_remote_code: true in your own recipe).")
    return files


def _tokenizer_needs_code(directory: Path) -> bool:
    """A tokenizer whose class transformers does not ship (only its auto_map names one)."""
    import transformers

    tok_map = _auto_map(directory / "tokenizer_config.json")
    if not tok_map:
        return False
    try:
        cls = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError, RecursionError):
        return False
    if not isinstance(cls, str):
        return True
    return not (hasattr(transformers, cls) or hasattr(transformers, cls.removesuffix("Fast")))
