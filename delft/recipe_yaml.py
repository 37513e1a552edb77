"""Reading a recipe's (or a study's, or a ``--set`` value's) YAML within bounds: at most ``MAX_BYTES``, no anchors
or aliases, nesting at most ``MAX_DEPTH`` deep, no key twice in one mapping, only plain YAML (safe_load's types).

A recipe is short and flat, so none of these limits bites a real one; each stops a file that would cost memory or
crash the loader instead of saying what is wrong. Anchors and depth are checked on the parser's events, before any
node is built: an alias bomb (a few lines whose aliases expand to gigabytes) is refused without being expanded,
and PyYAML's composer (recursive, one Python frame per level) never sees a deep nest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from delft.errors import UserError

MAX_BYTES = 1_000_000  # a recipe is a few kilobytes; this leaves room for long prompts and lists
MAX_DEPTH = 32  # sections nest four or five deep; PyYAML's composer fails near a few hundred


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def bounds_problem(text: str) -> str | None:
    """What makes ``text`` too costly to load (an anchor, an alias, nesting past MAX_DEPTH), or None; read from the
    parser's events, so nothing is built. Syntax errors raise yaml.YAMLError as yaml.load would."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            return f"uses the YAML alias *{event.anchor} at line {line}; anchors and aliases are not accepted"
        if isinstance(event, yaml.NodeEvent) and event.anchor is not None:
            return f"defines the YAML anchor &{event.anchor} at line {line}; anchors and aliases are not accepted"
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                return f"nests lists or mappings more than {MAX_DEPTH} deep (line {line})"
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return None


BOUNDS_FIX = "Write each value out in full (a recipe needs no anchors, aliases or deep nesting)."


def load_bounded(text: str, where: str) -> Any:
    """``text`` as plain Python values (safe_load's types, duplicate keys refused) once ``bounds_problem`` finds
    nothing; a problem is a UserError at ``where``; syntax errors raise yaml.YAMLError for the caller to word."""
    problem = bounds_problem(text)
    if problem is not None:
        raise UserError(problem, where, BOUNDS_FIX)
    return yaml.load(text, Loader=UniqueKeyLoader)


def read_text(path: Path) -> str:
    """The file's text, at most MAX_BYTES; a directory, a missing, unreadable, binary or oversized file is a clear
    error."""
    if path.is_dir():
        raise UserError(f"recipe {path} is a directory", fix="Give the recipe's YAML file.")
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist", fix="Check the path (see recipes/ for examples).")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # bounded even if the file grows after a size check
    except OSError as e:
        raise UserError(f"recipe file {path} cannot be read ({e.strerror})", fix="Check its permissions.") from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"is larger than {MAX_BYTES:,} bytes, too large for a recipe", str(path),
                        "A recipe is a short YAML file; keep data in a data file (data.source).")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"is not a text (UTF-8) file: byte 0x{raw[e.start]:02x} at line {line}", str(path),
                        "A recipe is a YAML text file; start from recipes/quickstart.yaml.") from None
    if "\x00" in text:
        raise UserError("is a binary file, not YAML", str(path), "Start from recipes/quickstart.yaml.")
    return text


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.max_steps=50", "loss.type=ce"]`` -> nested dict; values parsed as YAML (within recipe_yaml's
    bounds). A later --set of the same key wins; one below a key that an earlier --set made a value is refused."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE", fix="Write it as --set train.max_steps=50.")
        key, _, raw = item.partition("=")
        value = _override_value(item, raw)
        node = out
        parts = key.strip().split(".")
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                above = ".".join(parts[:i + 1])
                raise UserError(f"--set {_shown(item)} sets a key inside {above}, which an earlier --set made the "
                                f"value {node!r}", "command line",
                                f"Drop one of the two: {above} is either a value or a section of keys.")
        node[parts[-1]] = value
    return out


def _override_value(item: str, raw: str) -> Any:
    """A --set value as YAML (bounded like a recipe: no aliases, no deep nesting); text that is no YAML stays text."""
    if raw == "":
        return ""
    try:
        return load_bounded(raw, f"--set {_shown(item)}")
    except yaml.YAMLError:
        return raw


def _shown(item: str, most: int = 80) -> str:
    return item if len(item) <= most else item[:most - 3] + "..."
