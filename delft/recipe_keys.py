"""Every recipe key, its type, default and description, as Markdown generated from the schema (delft.recipe):
``docs/recipe_keys.md`` is this module's output (a test keeps it current; ``delft recipe keys`` prints it)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = ("# Every recipe key\n\nGenerated from the schema (`delft/recipe.py`) by `delft recipe keys > "
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
    from delft.recipe import Recipe

    lines = [HEADER]
    for name, field in Recipe.model_fields.items():
        lines += [f"## {name}", ""]
        lines += _rows(_section_model(field.annotation), name + ".")
    return "\n".join(lines).rstrip() + "\n"
