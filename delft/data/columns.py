"""data.columns: which of a file's columns holds each field its format reads, so a file with ``question`` and
``answer`` columns trains as prompt_completion without being rewritten (axolotl's ``field_*`` keys and
LLaMA-Factory's ``columns`` do the same). Keys are the format's field names, values the file's column names."""

from __future__ import annotations

from typing import Optional

from delft.errors import UserError

# The fields each row-reading format takes from a row (delft.data.sources.row_to_example); generated sources
# make their own examples and have no columns.
FORMAT_FIELDS = {
    "prompt_completion": ("prompt", "completion", "answer"),
    "alpaca": ("instruction", "input", "output"),
    "chat": ("messages", "answer"),
    "gsm8k": ("question", "answer"),
    "svamp": ("Body", "Question", "Answer"),
}


def columns_refusal(fmt: str, columns: Optional[dict]) -> Optional[str]:
    """Why a recipe's data.columns cannot apply to data.format ``fmt`` (the schema's message), or None."""
    if not columns:
        return None
    fields = FORMAT_FIELDS.get(fmt)
    if fields is None:
        return (f"columns name a file's columns, but format {fmt!r} generates its examples and reads no file: "
                "remove data.columns")
    unknown = [key for key in columns if key not in fields]
    if unknown:
        return (f"columns maps {', '.join(map(repr, unknown))}, which format {fmt!r} does not read; its fields are "
                f"{', '.join(fields)} (write field: column, e.g. prompt: question)")
    return None


def check_columns_present(rows: list[dict], columns: Optional[dict], label: str, where: str) -> None:
    """Refuse a data.columns entry that names a column no row of the file has: a misspelt column would
    otherwise surface as a missing field on row 1, under the field's name rather than the one the user wrote."""
    if not columns:
        return
    present: dict = {}
    for row in rows:
        present.update(dict.fromkeys(row))
    for field, column in columns.items():
        if column not in present:
            have = ", ".join(map(str, list(present)[:12])) + (", ..." if len(present) > 12 else "")
            raise UserError(f"{field} is mapped to the column {column!r}, which {label} does not have (its "
                            f"columns: {have})", f"{where}.columns",
                            f"Name one of those columns in data.columns.{field}, or remove that entry to read the "
                            f"{field!r} column.")
