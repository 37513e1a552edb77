"""Where examples come from: data files (jsonl, json, csv, parquet; alpaca, gsm8k, svamp and chat rows) and
hub datasets, each row read into an Example. Every field goes through delft.data.fields first."""

from __future__ import annotations

import json
import os
import re
import socket
import unicodedata
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional, Union

from delft.data.fields import (
    Fields,
    check_data_path,
    deepest,
    json_loads,
    read_csv,
    read_parquet,
    read_regular_bytes,
    too_deep,
)
from delft.errors import UserError

HUB_ID = r"[\w.-]+/[\w.-]+"  # org/name: what delft treats as a hub id (models and datasets)


LOCAL_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Example:
    prompt: Union[str, list[dict]]  # text, or chat messages up to (not including) the answer
    completion: str  # what the model learns to produce
    answer: Optional[str] = None  # numeric gold as text, for eval
    row: int = 0  # row in the source (for error messages)
    item: Any = None  # a generated problem's own record (reasoning-gym's entry, which its score_answer reads)


def normalised_prompt(prompt: Union[str, list[dict]]) -> str:
    """The text that says which problem an example asks, the one key for "this eval problem is a training problem"
    (counted by delft eval, compare and study; skipped when a generated eval set is drawn).

    Every run of whitespace becomes one space and the ends are stripped: files of one data set differ in line
    ends, indentation and trailing newlines, and the template lays the prompt out anew anyway. Unicode is put in
    NFC, so one character written two ways is one. Case is kept: it is part of what the model reads, copies of a
    problem keep it, and folding it would merge problems that differ in it (a letter to count, a variable name).
    A chat prompt is its messages' contents in order, system messages left out: a system message is a fixed
    instruction, not the problem (other formats get theirs from data.system_prompt, outside the example too).
    """
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt if m.get("role") != "system")
    return " ".join(unicodedata.normalize("NFC", str(prompt)).split())


def format_number(value: Decimal) -> str:
    """Plain decimal text without exponent or trailing zeros: Decimal('1.50') -> '1.5', -0 -> '0'."""
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def is_data_file(source: str) -> bool:
    """Whether a data.source (of a format that reads rows) names a file here rather than a hub dataset."""
    path = Path(source).expanduser()
    return path.suffix.lower() in LOCAL_LOADERS or path.exists() or path.is_symlink()


def load_rows(cfg, where: str) -> tuple[list[dict], str]:
    """Rows as dicts and a label for messages ("data.jsonl")."""
    source = cfg.source
    path = Path(source).expanduser()
    if is_data_file(source):
        check_data_path(path, source, where)
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return _read_jsonl(path, _read_text(path, where), where), path.name
        if suffix == ".json" or (cfg.format == "svamp" and suffix not in LOCAL_LOADERS):  # SVAMP.json, renamed
            return _read_json(path, _read_text(path, where), where), path.name
        if suffix == ".csv":
            return read_csv(path, _read_text(path, where), where), path.name
        if suffix == ".parquet":
            return read_parquet(path, where), path.name
        raise UserError(f"unsupported data file type {path.suffix!r}", f"{where}.source",
                        "Use .jsonl, .json, .csv or .parquet.")
    if re.fullmatch(HUB_ID, source):
        return _load_hub_rows(cfg, where), source
    raise UserError(f"data source {source!r} is neither a file nor a hub id", f"{where}.source",
                    "Give a .jsonl/.json/.csv/.parquet path, a hub id (org/name) or 'synthetic'.")


def _read_text(path: Path, where: str) -> str:
    """A text data file as str; a byte that is not UTF-8 is named by line, not a traceback."""
    raw = read_regular_bytes(path, where)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"{path.name} line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x})", f"{where}.source",
                        "Save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or fix that line.") from None


RECORD = '{"prompt": "2 + 3 =", "completion": "5"}'  # a record, as the refusals show one


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words ("a JSON object", "a number", ...)."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "true/false"
    return "null" if value is None else "a number"


def _read_json(path: Path, text: str, where: str) -> list[dict]:
    """A .json data file: a JSON list of records (objects). JSON Lines under a .json name are read as JSON Lines;
    valid JSON of another shape (an object, a list of numbers, a string) is refused by name."""
    try:
        data = json_loads(text)
    except RecursionError:
        depth, line, item = deepest(text)
        raise too_deep(path.name, f"item {item} (line {line})", depth, where) from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and not text.lstrip().startswith("["):  # one object per line, named .json
            return _read_jsonl(path, text, where)
        raise UserError(f"{path.name} is not valid JSON (line {e.lineno}: {e.msg})", f"{where}.source",
                        "Fix the file.") from None
    fix = f"Give a JSON list with one object per record, [{RECORD}, ...], or a .jsonl file with one per line."
    if not isinstance(data, list):
        keys = f" (keys: {', '.join(map(str, list(data)[:5]))})" if isinstance(data, dict) else ""
        lists = [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, dict) else []
        if lists:
            fix = f"If the records are the list under {lists[0]!r}, write that list alone to the file. " + fix
        raise UserError(f"{path.name} holds {_json_kind(data)}{keys}, not a list of records", f"{where}.source", fix)
    if not data:
        raise UserError(f"{path.name} is an empty list: it holds no records", f"{where}.source",
                        "Give a file with at least one record.")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path.name} item {i + 1} is {_json_kind(row)} ({json.dumps(row)[:40]}), not a "
                            "record (a JSON object)", f"{where}.source", fix)
    return data


def _read_jsonl(path: Path, text: str, where: str = "data") -> list[dict]:
    """JSON Lines: one record (a JSON object) per line; blank lines are skipped."""
    rows = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json_loads(line)
        except RecursionError:
            raise too_deep(path.name, f"row {lineno}", deepest(line)[0], where) from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path.name} row {lineno} is not valid JSON ({e.msg})", f"{where}.source",
                            "Fix or remove that line.") from None
        if not isinstance(row, dict):
            fix = f"Write one object per line, e.g. {RECORD}."
            if isinstance(row, list):
                fix = ("A whole JSON list belongs in a .json file; in a .jsonl file write one object per line, "
                       f"e.g. {RECORD}.")
            raise UserError(f"{path.name} row {lineno} is {_json_kind(row)} ({line.strip()[:40]}), not a record "
                            "(a JSON object)", f"{where}.source", fix)
        rows.append(row)
    if not rows:
        raise UserError(f"data file {path} has no rows", f"{where}.source", "Give a file with at least one row.")
    return rows


def _load_hub_rows(cfg, where: str) -> list[dict]:
    import os

    import datasets


    if os.environ.get("HF_DATASETS_OFFLINE") != "1" and os.environ.get("HF_HUB_OFFLINE") != "1" \
            and not hub_reachable():
        os.environ["HF_DATASETS_OFFLINE"] = "1"  # use the local cache only; fail fast instead of retrying
    try:
        ds = datasets.load_dataset(cfg.source, cfg.subset, split=cfg.split)
    except Exception as e:
        raise UserError(f"could not load hub dataset {cfg.source!r} (split {cfg.split!r}): "
                        f"{str(e).splitlines()[0][:200]}", f"{where}.source",
                        "Without network, download it elsewhere and point data.source at a local file.") from None
    return [dict(r) for r in ds]


def _gsm8k_answer(text: str, label: str, i: int, where: str) -> str:
    m = re.search(r"####\s*(-?[\d,]*\.?\d+)\s*$", text.strip())
    if not m:
        raise UserError(f"{label} row {i + 1}: 'answer' does not end with '#### NUMBER'", f"{where}.format",
                        "Use format prompt_completion for other data.")
    return format_number(Decimal(m.group(1).replace(",", "")))


def row_to_example(row: dict, fmt: str, i: int, label: str, where: str = "data",
                   columns: Optional[dict] = None) -> Example:
    """One row as an Example. Every field it uses must be text (a completion or answer may be a finite number,
    used as its plain text); delft.data.fields refuses anything else by file, row and field. ``columns``
    (data.columns) names the row's column for a field the format reads."""
    f = Fields(row, label, i, where, columns)
    if fmt == "prompt_completion":
        return Example(f.text("prompt"), f.text("completion", number=True),
                       f.text("answer", number=True, required=False), i)
    if fmt == "alpaca":
        instruction, output = f.text("instruction"), f.text("output", number=True)
        extra = f.text("input", required=False) or ""
        prompt = (ALPACA_PROMPT_INPUT if extra else ALPACA_PROMPT).format(instruction=instruction, input=extra)
        return Example(prompt, output, None, i)
    if fmt == "gsm8k":
        question, answer = f.text("question"), f.text("answer")
        completion = re.sub(r"<<[^>]*>>", "", answer)  # calculator annotations are not language
        return Example(question, completion, _gsm8k_answer(answer, label, i, where), i)
    if fmt == "svamp":
        body, question, answer = f.text("Body"), f.text("Question"), f.number("Answer")
        return Example(f"{body.strip()} {question.strip()}", answer, answer, i)
    if fmt == "chat":
        messages = f.messages()
        if messages[-1]["role"] != "assistant":
            raise UserError(f"{label} row {i + 1}: the last message must be the assistant's answer",
                            f"{where}.format", "Only the last assistant turn is trained on.")
        return Example(list(messages[:-1]), messages[-1]["content"], f.text("answer", number=True, required=False),
                       i)
    raise UserError(f"unknown data format {fmt!r}", f"{where}.format", "See delft recipe check for the choices.")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (or HF_ENDPOINT) answers on port 443 within ``timeout`` seconds."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^https?://", "", endpoint).split("/")[0].split(":")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
