"""What a data file may hold, field by field: text (or, where an answer is meant, a finite number, used as its plain
text); anything else is refused naming file, row, field and what it is. Also the readers that make that possible:
JSON with NaN / Infinity / 1e999999 / over-long integers kept as markers the checks name (Python's json would
hand back nan, inf or raise), CSV read strictly, parquet read whole, and the check that a data path is a file.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import reprlib
import stat
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Optional

from delft.errors import UserError

NON_FINITE_FIX = ("NaN, Infinity and numbers beyond a float's range (such as 1e999999) are no value to train on: "
                  "write a finite number, or the text as a string.")
NOT_FINITE = "which is not a finite number"
CSV_FIX = ('Quote a value that holds a comma, a quote or a line break ("a, b"), double a quote inside one (""), and '
           "close every quote; every row needs as many fields as the header.")
FILE_KINDS = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISFIFO: "a named pipe (FIFO)",
              stat.S_ISSOCK: "a socket"}
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 40, 40, 2, 4, 4


@dataclass(frozen=True)
class Unreadable:
    """A JSON number Python holds as no finite value: NaN, Infinity, 1e999999, or an integer longer than Python
    converts from text. Kept as written, so the row and field it sits in are named, not trained on as "nan"."""

    text: str
    why: str  # "which is not a finite number" / "an integer of N digits, longer than Python reads from text"
    fix: str = NON_FINITE_FIX


def _json_int(text: str):
    try:
        return int(text)
    except ValueError:  # past sys.get_int_max_str_digits()
        return Unreadable(text, f"an integer of {len(text.lstrip('-'))} digits, longer than Python reads from text",
                          "Write it as a string if those digits are meant, or fix the row.")


def _json_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else Unreadable(text, NOT_FINITE)


def json_loads(text: str) -> Any:
    """json.loads, with non-finite and over-long numbers as Unreadable markers. RecursionError (a value nested
    deeper than the interpreter's stack) is left to the caller, who knows the row."""
    return json.loads(text, parse_int=_json_int, parse_float=_json_float,
                      parse_constant=lambda name: Unreadable(name, NOT_FINITE))


def deepest(text: str) -> tuple[int, int, int]:
    """(depth, line, top-level item) where ``text``'s JSON nesting is deepest: names the place a RecursionError
    came from (items count from 1 inside a top-level list)."""
    depth = best = item = best_item = best_at = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{},]', text):
        token = m.group()
        if token in "[{":
            depth += 1
            if depth > best:
                best, best_at, best_item = depth, m.start(), item
        elif token in "]}":
            depth -= 1
        elif token == "," and depth == 1:
            item += 1
    return best, text.count("\n", 0, best_at) + 1, best_item + 1


def too_deep(label: str, place: str, depth: int, where: str) -> UserError:
    return UserError(f"{label} {place} nests a JSON value {depth} levels deep, deeper than Python's JSON reader goes",
                     f"{where}.source", "A record holds text fields (and a list of messages for format chat): fix "
                     "or remove that record.")


# ----------------------------------------------------------------------------- the path itself


def check_data_path(path: Path, source: str, where: str, missing_fix: str = "Check the path.") -> None:
    """``path`` is a regular file with something in it; a missing path, a dangling symlink, a directory, a device,
    a pipe or a socket (which would block or never end) is refused by what it is."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise UserError(f"data file {source} is a symlink to {os.readlink(path)}, which does not exist",
                            f"{where}.source", missing_fix) from None
        raise UserError(f"data file {source} does not exist", f"{where}.source", missing_fix) from None
    except OSError as e:
        raise UserError(f"data file {source} cannot be read ({e.strerror})", f"{where}.source",
                        "Check the path and its permissions.") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"data source {source} is a directory", f"{where}.source",
                        "Name the data file itself (.jsonl, .json, .csv or .parquet).")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in FILE_KINDS.items() if test(st.st_mode)), "not a regular file")
        via = f" (a symlink to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise UserError(f"data file {source} is {kind}{via}, not a regular file", f"{where}.source",
                        "Name a data file (.jsonl, .json, .csv or .parquet) itself: delft reads no devices, pipes or "
                        "sockets.")
    if st.st_size == 0:
        raise UserError(f"data file {source} is empty", f"{where}.source", "Give a file with at least one row.")


def read_regular_bytes(path: Path, where: str) -> bytes:
    """The file's bytes, opened without blocking and checked to be a regular file once open (a path swapped for a
    pipe after check_data_path would hang a plain read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise UserError(f"data file {path} cannot be read ({e.strerror})", f"{where}.source",
                        "Check its permissions.") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"data file {path} is not a regular file", f"{where}.source",
                            "Name a data file (.jsonl, .json, .csv or .parquet) itself.")
        return f.read()


# ----------------------------------------------------------------------------- CSV and parquet


def read_csv(path: Path, text: str, where: str) -> list[dict]:
    """CSV with a header line, read strictly: a row with more or fewer fields than the header, or a quote never
    closed, is refused by line (a lenient reader shifts such rows into the wrong columns). Values stay text as
    written; an empty cell is no value (None)."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: Optional[list[str]] = None
    rows: list[dict] = []
    start = 1
    try:
        for record in reader:
            if all(not v.strip() for v in record):  # a blank line
                start = reader.line_num + 1
                continue
            if header is None:
                header = _csv_header(path, record, where)
            elif len(record) != len(header):
                fields = f"{len(record)} field{'s' * (len(record) != 1)}"
                raise UserError(f"{path.name} row {len(rows) + 1} (line {start}) has {fields}, the header "
                                f"{len(header)} ({', '.join(header)})", f"{where}.source", CSV_FIX)
            else:
                rows.append({k: (v if v != "" else None) for k, v in zip(header, record)})
            start = reader.line_num + 1
    except csv.Error as e:
        raise UserError(f"{path.name} row {len(rows) + 1} (from line {start}) is not valid CSV ({e})",
                        f"{where}.source", CSV_FIX) from None
    if not rows:
        raise UserError(f"data file {path} has no rows", f"{where}.source", "Give a file with at least one row.")
    return rows


def _csv_header(path: Path, record: list[str], where: str) -> list[str]:
    names = [v.strip() for v in record]
    twice = sorted({n for n in names if n and names.count(n) > 1})
    if twice:
        raise UserError(f"{path.name}'s header names column(s) {', '.join(twice)} more than once", f"{where}.source",
                        "Give every column its own name.")
    return names


def read_parquet(path: Path, where: str) -> list[dict]:
    """A parquet table's rows as dicts (pyarrow's Python values: bytes, lists and structs stay what they are, for
    the field checks to name); a table with no rows is refused as such."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        if table.num_rows == 0:
            columns = ", ".join(table.column_names) or "none"
            raise UserError(f"{path.name} is a parquet table with 0 rows (columns: {columns})", f"{where}.source",
                            "Give a table with at least one row.")
        return table.to_pylist()
    except UserError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others on a damaged or foreign file
        said = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(f"could not read {path.name} as parquet: {said}", f"{where}.source",
                        "Check that it is a parquet file (written by pandas, pyarrow or datasets).") from None


# ----------------------------------------------------------------------------- fields


def kind_of(value: Any) -> str:
    """What a field holds, in words, with a short repr: "a list (['a', 'b'])", "true/false (True)"."""
    if isinstance(value, Unreadable):
        return f"the JSON number {value.text[:20]}{'...' if len(value.text) > 20 else ''}, {value.why}"
    if isinstance(value, bool):
        return f"true/false ({value})"
    names = {str: "a string", dict: "an object", list: "a list", tuple: "a list", bytes: "bytes", bytearray: "bytes",
             float: "a number", int: "a number", Decimal: "a number"}
    name = next((n for t, n in names.items() if isinstance(value, t)), f"a {type(value).__name__}")
    return f"{name} ({_SHORT.repr(value)})"


def finite_number_text(value: Any) -> Optional[str]:
    """A finite int / float / Decimal as plain text (42 -> "42", 2.5 -> "2.5", 1e20 -> "100000000000000000000");
    None for anything else, booleans included."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        return None
    number = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if not number.is_finite():
        return None
    text = format(number, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


class Fields:
    """One row's fields, read as text; a field of another kind is refused naming file, row and field."""

    def __init__(self, row: dict, label: str, index: int, where: str, columns: Optional[dict] = None):
        self.row, self.label, self.n, self.where = row, label, index + 1, where
        self.columns = columns or {}  # data.columns: a field's name -> the file's column that holds it

    def col(self, name: str) -> str:
        """The column that holds field ``name`` (data.columns), the name every message shows."""
        return self.columns.get(name, name)

    def refuse(self, name: str, value: Any, fix: str) -> UserError:
        if isinstance(value, Unreadable):  # kind_of says why already
            return UserError(f"{self.label} row {self.n}, field {name!r}, is {kind_of(value)}", f"{self.where}.source",
                             value.fix)
        return UserError(f"{self.label} row {self.n}, field {name!r}, is {kind_of(value)}, not text",
                         f"{self.where}.source", fix)

    def get(self, name: str, required: bool = True) -> Any:
        name = self.col(name)
        value = self.row.get(name)
        if value is None and required:
            if name in self.row:
                raise UserError(f"{self.label} row {self.n}, field {name!r}, is empty (null)", f"{self.where}.source",
                                "Fill it in, or remove the row.")
            fields = ", ".join(map(str, self.row))
            raise UserError(f"{self.label} row {self.n} has no {name!r} field (fields: {fields})",
                            f"{self.where}.format", "Check data.format, or fix the row.")
        return value

    def text(self, name: str, number: bool = False, required: bool = True, value: Any = None) -> Optional[str]:
        """The field as text. ``number``: a finite number also stands for it, as its plain text (an answer or a
        completion); otherwise (a prompt) only a string does."""
        value = self.get(name, required) if value is None else value
        if value is None or isinstance(value, str):
            return value
        name = self.col(name)
        plain = finite_number_text(value) if number else None
        if plain is not None:
            return plain
        fix = (f"Write {name!r} as a string, or as a finite number (used as its plain text)." if number else
               f"Write {name!r} as a string (text) in every row.")
        if isinstance(value, (list, dict)) and not number:
            fix += " Chat messages go in a 'messages' list of {role, content} objects, with data.format: chat."
        raise self.refuse(name, value, fix)

    def number(self, name: str) -> str:
        """A numeric answer's plain text: a finite number, or a string that is one ("51", "2.5")."""
        value = self.get(name)
        text = self.text(name, number=True, value=value)
        try:
            parsed = Decimal(text.strip().replace(",", ""))
        except InvalidOperation:
            parsed = None
        name = self.col(name)
        if parsed is None or not parsed.is_finite():
            raise UserError(f"{self.label} row {self.n}, field {name!r}, is {kind_of(value)}, not a number",
                            f"{self.where}.source", f"Write {name!r} as a finite number, e.g. 51 or 2.5.")
        return finite_number_text(parsed)

    def messages(self) -> list[dict]:
        """format chat's 'messages': a list of {role, content} objects whose role and content are strings."""
        messages, name = self.get("messages"), self.col("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise UserError(f"{self.label} row {self.n}: {name!r} must be a list of {{role, content}} objects",
                            f"{self.where}.format", "Fix the row.")
        for k, m in enumerate(messages):
            for key in ("role", "content"):
                if not isinstance(m[key], str):
                    raise self.refuse(f"{name}[{k}].{key}", m[key], f"Write every message's {key} as a string.")
        return messages
