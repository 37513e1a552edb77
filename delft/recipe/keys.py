"""Recipe keys as data: every key flattened to its dotted path, the keys two recipes differ in (resume and
compare use it), and the Markdown key reference ``docs/recipe_keys.md`` generated from the schema (a test keeps
it current; ``delft recipe keys`` prints it)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from delft.recipe.schema import Recipe


def flat_keys(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: {"train": {"seed": 0}} -> {"train.seed": 0}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_keys(v, key + "."))
        else:
            out[key] = v
    return out


def recipe_differences(old: Recipe, new: Recipe, ignore: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose values differ, skipping keys equal to or under any prefix in ``ignore``."""
    a, b = flat_keys(old.to_dict()), flat_keys(new.to_dict())
    keys = list(a) + [k for k in b if k not in a]
    return [k for k in keys
            if not any(k == p or k.startswith(p + ".") for p in ignore) and a.get(k) != b.get(k)]


HEADER = ("# Every recipe key\n\nGenerated from the schema (`delft/recipe/schema.py`) by `delft recipe keys > "
          "docs/recipe_keys.md`; a test fails when it is stale. A key not listed here is refused with a "
          "did-you-mean. [recipes.md](recipes.md) explains them with the quickstart recipe.\n")


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is typing.Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" (or unset)" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {int: "whole number", float: "number", str: "text", bool: "true/false"}.get(annotation, str(annotation))


def _default(field) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    return f"`{value}`"


def _section_model(annotation):
    for cand in (annotation, *typing.get_args(annotation)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def _rows(model, prefix: str) -> list[str]:
    rows, subsections = [], []
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        if sub is not None:
            subsections.append((f"{prefix}{name}", sub, field.description))
            continue
        text = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | {_type_name(field.annotation)} | {_default(field)} | {text} |")
    out = ["| key | type | default | what it does |", "|---|---|---|---|", *rows, ""] if rows else []
    for key, sub, text in subsections:
        out += [f"### {key}", "", *( [text, ""] if text else []), *_rows(sub, key + ".")]
    return out


def reference_markdown() -> str:

    lines = [HEADER]
    for name, field in Recipe.model_fields.items():
        lines += [f"## {name}", ""]
        lines += _rows(_section_model(field.annotation), name + ".")
    return "\n".join(lines).rstrip() + "\n"
