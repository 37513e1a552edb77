"""The base of every recipe section (``Section``): unknown keys refused, no inf or nan, YAML's yes/no/on/off read
as the words a field offers or refused where a number is expected, no NUL character in any text and no whole number
past 64 bits. Torch-free, as the whole schema."""

from __future__ import annotations

import typing
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator


class Section(BaseModel):
    # Typos must fail loudly ("quantizaton: 4bit" silently passing is a peer's bug we do not repeat).
    # No inf/nan: an infinite learning rate or loss weight is never meant.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_yaml_booleans(cls, data):
        """YAML reads yes/no/on/off as booleans: refuse one where a number or a name is expected (pydantic would
        make ``learning_rate: yes`` 1.0), and read on/off as the words for a field that offers them."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if not isinstance(value, bool) or field is None or _accepts(field.annotation, value):
                continue
            word = ("off", "on")[value]
            if _accepts(field.annotation, word):
                data[key] = word
            else:
                raise ValueError(f"{key} got the YAML boolean {value} (from yes/no/on/off/true/false), "
                                 f"which is not a {_kind(field.annotation)}")
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _plain_value(cls, value, info: ValidationInfo):
        """No NUL character in any text (no path, name or prompt holds one; the OS cuts paths at it), and no whole
        number past 64 bits (a seed of 1e30 would overflow torch's generators deep inside training)."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, dict) and _holds_section(annotation):
            return value  # the section checks its own keys, so the message names the key
        if _has_nul(value):
            raise ValueError("holds a NUL character (\\0), which no path, name or text may hold")
        if _whole(annotation):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 2 ** 63:
                    raise ValueError("too large for a whole number (at most 2**63 - 1)")
        return value


def _has_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return isinstance(value, (list, tuple)) and any(_has_nul(v) for v in value)


def _holds_section(annotation) -> bool:
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in (annotation, *typing.get_args(annotation)))


def _whole(annotation) -> bool:
    """Whether a field holds whole numbers: int, Optional[int], a list or tuple of them."""
    return annotation is int or any(_whole(a) for a in typing.get_args(annotation))


def _accepts(annotation, value) -> bool:
    """Whether a field's type takes ``value`` as it is: bool for a bool field, a word for a Literal that lists it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return value in args and not isinstance(value, bool)
    if origin is Union:
        return any(_accepts(a, value) for a in args)
    return annotation is bool and isinstance(value, bool)


def _kind(annotation) -> str:
    names = {int: "whole number", float: "number", str: "text"}
    found = [names[a] for a in (annotation, *typing.get_args(annotation)) if a in names]
    return found[0] if found else "choice such as " + ", ".join(repr(a) for a in typing.get_args(annotation)[:4])
