"""Data: sources (files, hub, synthetic) -> Examples -> token ids with completion-only labels -> batches."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import random
import re
import socket
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional, Union

from delft.data_fields import (
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
from delft.numbers.tokens import IGNORE

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


# ----------------------------------------------------------------------------- numbers


def format_number(value: Decimal) -> str:
    """Plain decimal text without exponent or trailing zeros: Decimal('1.50') -> '1.5', -0 -> '0'."""
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


# ----------------------------------------------------------------------------- synthetic arithmetic


def _operand(rng: random.Random, cfg, decimals: int, second: bool = False) -> Decimal:
    low_digits, high_digits = (cfg.min_digits, cfg.max_digits)
    if second and cfg.second_digits is not None:
        low_digits, high_digits = cfg.second_digits
    digits = rng.randint(low_digits, high_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    value = Decimal(rng.randint(low, 10**digits - 1))
    if decimals:
        value += Decimal(rng.randint(1, 10**decimals - 1)) / Decimal(10**decimals)
    if rng.random() < cfg.negative_fraction:
        value = -value
    return value


def synthetic_examples(cfg) -> list[Example]:
    """Seeded arithmetic problems with exact answers (division is generated from its quotient; "copy" asks to
    repeat one operand). Arithmetic runs in an exact context: operands may have up to 30 digits."""
    from delft.numbers.digits import exact_context

    rng = random.Random(cfg.seed)
    out = []
    with exact_context():
        for i in range(cfg.n):
            question, answer = _synthetic_problem(rng, cfg)
            out.append(Example(question, answer, answer, i))
    return out


def _synthetic_problem(rng: random.Random, cfg) -> tuple[str, str]:
    """(question, answer) of one problem, drawn from ``rng``."""
    op = rng.choice(cfg.ops)
    decimals = rng.choice([1, 2]) if rng.random() < cfg.decimal_fraction else 0
    if op == "copy":
        a = _operand(rng, cfg, decimals)
        return f"Repeat {format_number(a)}", format_number(a)
    a, b = _operand(rng, cfg, decimals), _operand(rng, cfg, decimals if op in "+-" else 0, second=True)
    if op == "/":
        b = b if b != 0 else Decimal(rng.randint(1, 9))
        q = _operand(rng, cfg, decimals)
        a = b * q
    result = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if op == "/" else None}[op]
    return f"What is {format_number(a)} {op} {format_number(b)}?", format_number(result)


# ----------------------------------------------------------------------------- reasoning-gym


RG_INSTALL = 'pip install "delft-digits[reasoning]" (reasoning-gym, whose generators need no download)'


def reasoning_gym_dataset(cfg, where: str = "data"):
    """reasoning-gym's generated dataset for ``cfg`` (a ReasoningGymConfig); a missing package, an unknown task or
    option is a UserError naming it."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise UserError("data.source reasoning_gym needs the reasoning-gym package, which is not installed",
                        f"{where}.source", f"Install it: {RG_INSTALL}.") from None
    if cfg.task not in DATASETS:
        close = difflib.get_close_matches(cfg.task, list(DATASETS), n=3)
        hint = f"Did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"reasoning-gym has no task {cfg.task!r}", f"{where}.reasoning_gym.task",
                        f"{hint}Its {len(DATASETS)} tasks: python -c 'import reasoning_gym.factory as f; "
                        "print(sorted(f.DATASETS))'.")
    fields = {f.name for f in dataclasses.fields(DATASETS[cfg.task][1])} - {"seed", "size"}
    unknown = sorted(set(cfg.options) - fields)
    if unknown:
        raise UserError(f"reasoning-gym task {cfg.task} has no option(s) {', '.join(unknown)}",
                        f"{where}.reasoning_gym.options", f"Its options: {', '.join(sorted(fields))}.")
    try:
        return reasoning_gym.create_dataset(cfg.task, size=cfg.n, seed=cfg.seed, **cfg.options)
    except (AssertionError, ValueError, TypeError) as e:  # its configs validate with assert
        raise UserError(f"reasoning-gym refused the options of {cfg.task}: {e or type(e).__name__}",
                        f"{where}.reasoning_gym.options", "Check the values against the task's config.") from None


def reasoning_gym_examples(cfg, where: str = "data") -> list[Example]:
    """The generated problems as examples: the question as prompt, the answer (or the worked solution, with
    ``completion: cot`` where the task has one) as completion, the entry kept for the task's own scorer."""
    out = []
    for i, entry in enumerate(reasoning_gym_dataset(cfg, where)):
        answer = str(entry["answer"])
        cot = (entry.get("metadata") or {}).get("answer_cot")
        if cfg.completion == "cot" and not cot:
            raise UserError(f"reasoning-gym task {cfg.task} has no worked solutions (metadata answer_cot)",
                            f"{where}.reasoning_gym.completion", "Use completion: answer (gsm_symbolic has them).")
        out.append(Example(str(entry["question"]), str(cot) if cfg.completion == "cot" else answer, answer, i, entry))
    return out


# ----------------------------------------------------------------------------- reading rows


def is_data_file(source: str) -> bool:
    """Whether a data.source (of a format that reads rows) names a file here rather than a hub dataset."""
    path = Path(source).expanduser()
    return path.suffix.lower() in LOCAL_LOADERS or path.exists() or path.is_symlink()


def _load_rows(cfg, where: str) -> tuple[list[dict], str]:
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


# ----------------------------------------------------------------------------- formats


def _gsm8k_answer(text: str, label: str, i: int, where: str) -> str:
    m = re.search(r"####\s*(-?[\d,]*\.?\d+)\s*$", text.strip())
    if not m:
        raise UserError(f"{label} row {i + 1}: 'answer' does not end with '#### NUMBER'", f"{where}.format",
                        "Use format prompt_completion for other data.")
    return format_number(Decimal(m.group(1).replace(",", "")))


def row_to_example(row: dict, fmt: str, i: int, label: str, where: str = "data") -> Example:
    """One row as an Example. Every field it uses must be text (a completion or answer may be a finite number,
    used as its plain text); delft.data_fields refuses anything else by file, row and field."""
    f = Fields(row, label, i, where)
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


def load_examples(cfg, where: str = "data") -> list[Example]:
    if cfg.format == "synthetic":
        examples = synthetic_examples(cfg.synthetic)[: cfg.limit]
    elif cfg.format == "reasoning_gym":
        examples = reasoning_gym_examples(cfg.reasoning_gym, where)[: cfg.limit]
    else:
        rows, label = _load_rows(cfg, where)
        examples = [row_to_example(r, cfg.format, i, label, where) for i, r in enumerate(rows[: cfg.limit])]
    if not examples:
        raise UserError("the data source gave no examples", f"{where}.source", "Check the file and data.limit.")
    return examples


# ----------------------------------------------------------------------------- prompts and tokens


def use_chat_template(tokenizer, cfg) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if cfg.template == "chat" and not has:
        raise UserError("data.template is 'chat' but the tokenizer has no chat template", "data.template",
                        "Use template: plain (or auto).")
    return cfg.format == "chat" or (cfg.template != "plain" and has)


def _messages(example: Example, cfg) -> list[dict]:
    msgs = list(example.prompt) if isinstance(example.prompt, list) else [{"role": "user", "content": example.prompt}]
    if cfg.system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": cfg.system_prompt})
    return msgs


def render_prompt(example: Example, tokenizer, cfg) -> str:
    """The exact text the answer continues (chat template applied when configured)."""
    if use_chat_template(tokenizer, cfg):
        return tokenizer.apply_chat_template(_messages(example, cfg), tokenize=False, add_generation_prompt=True)
    if isinstance(example.prompt, list):
        return "\n".join(m["content"] for m in example.prompt) + "\n"
    prompt = example.prompt
    return prompt if prompt.endswith(("\n", " ")) else prompt + "\n"


def render_pair(example: Example, tokenizer, cfg) -> tuple[str, str]:
    """(prompt text, completion text including the end-of-turn / EOS the model must learn)."""
    prompt = render_prompt(example, tokenizer, cfg)
    if use_chat_template(tokenizer, cfg):
        full = tokenizer.apply_chat_template(
            _messages(example, cfg) + [{"role": "assistant", "content": example.completion}], tokenize=False)
        if full.startswith(prompt):
            return prompt, full[len(prompt):]
    return prompt, example.completion + (tokenizer.eos_token or "")


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a rendered prompt, the same in training, eval and inspect: no special tokens added, except
    a BOS for tokenizers that ask for one (Llama-2 style) when the text lacks it."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


# Characters kept per token of data.max_length before tokenizing: far more than any tokenizer's token holds, so
# cutting there changes no kept token, and a huge line is not tokenized whole only to be truncated.
CHARS_PER_TOKEN_BUDGET = 32


def cut_to_budget(prompt: str, completion: str, max_length: int) -> tuple[str, str, bool]:
    """(prompt, completion, cut?) within max_length * CHARS_PER_TOKEN_BUDGET characters together."""
    budget = max_length * CHARS_PER_TOKEN_BUDGET
    if len(prompt) + len(completion) <= budget:
        return prompt, completion, False
    return prompt[:budget], completion[:max(0, budget - len(prompt))], True


def tokenize_example(example: Example, tokenizer, cfg) -> Tokenized:
    """Prompt and completion are tokenized apart so the mask boundary is exact."""
    prompt, completion, cut = cut_to_budget(*render_pair(example, tokenizer, cfg), cfg.max_length)
    p_ids = prompt_ids(tokenizer, prompt)
    c_ids = tokenizer.encode(completion, add_special_tokens=False)
    ids = p_ids + c_ids
    labels = (list(p_ids) if cfg.train_on_prompt else [IGNORE] * len(p_ids)) + list(c_ids)
    truncated = cut or len(ids) > cfg.max_length
    return Tokenized(ids[: cfg.max_length], labels[: cfg.max_length], truncated)


@dataclass
class DataStats:
    examples: int = 0
    train: int = 0
    val: int = 0
    tokens: int = 0
    label_tokens: int = 0
    digit_labels: int = 0
    truncated: int = 0
    fully_masked: int = 0
    notes: list[str] = field(default_factory=list)


def build_datasets(cfg, tokenizer, seed: int, digit_ids: Optional[set] = None, where: str = "data"):
    """Tokenize every example, drop (and count) ones with no trainable label, split off validation."""
    examples = load_examples(cfg, where)
    stats = DataStats(examples=len(examples))
    items = []
    for ex in examples:
        tok = tokenize_example(ex, tokenizer, cfg)
        stats.truncated += tok.truncated
        n_labels = sum(1 for t in tok.labels if t != IGNORE)
        if n_labels == 0:
            stats.fully_masked += 1
            continue
        stats.tokens += len(tok.input_ids)
        stats.label_tokens += n_labels
        if digit_ids:
            stats.digit_labels += sum(1 for t in tok.labels if t in digit_ids)
        items.append(tok)
    if not items:
        raise UserError(
            f"every one of the {len(examples)} examples has all its labels masked (nothing to learn), e.g. prompts "
            f"longer than data.max_length={cfg.max_length} or empty completions", f"{where}.source",
            "Raise data.max_length, check the completion field, or set data.train_on_prompt: true.")
    rng = random.Random(seed)
    order = list(range(len(items)))
    rng.shuffle(order)
    n_val = validation_count(cfg.val_size, len(items), where)
    val = [items[i] for i in order[:n_val]]
    train = [items[i] for i in order[n_val:]]
    stats.train, stats.val = len(train), len(val)
    return train, val, stats


def validation_count(val_size: float, n: int, where: str) -> int:
    """Examples held out: a fraction (<1) of ``n`` or a count; a count that takes more than half is refused."""
    if val_size < 1:
        return min(int(round(val_size * n)), n - 1)
    count = int(val_size)
    if count > n // 2:
        raise UserError(f"val_size {count} would take {min(count, n - 1)} of the {n} usable examples for "
                        f"validation, leaving {max(1, n - count)} to train on", f"{where}.val_size",
                        f"Use a fraction (e.g. val_size: 0.1) or a count of at most {n // 2}.")
    return count


# ----------------------------------------------------------------------------- batches


def collate(items: list[Tokenized], pad_id: int) -> dict:
    """Right-padded batch. Labels stay aligned with input_ids (the loss shifts them)."""
    import torch

    width = max(len(t.input_ids) for t in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, t in enumerate(items):
        n = len(t.input_ids)
        ids[i, :n] = torch.tensor(t.input_ids)
        labels[i, :n] = torch.tensor(t.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def collate_packed(items: list[Tokenized], pad_id: int, row_length: int) -> dict:
    """Examples laid end to end in rows; position ids restart per example so attention stays inside it.

    transformers builds a block-diagonal causal mask from restarting position_ids when no attention_mask is
    given. The first label of every example is masked, so no target and no digit run crosses a boundary.
    """
    import torch

    rows: list[list[Tokenized]] = []
    for t in items:
        if rows and sum(len(x.input_ids) for x in rows[-1]) + len(t.input_ids) <= row_length:
            rows[-1].append(t)
        else:
            rows.append([t])
    width = max(sum(len(x.input_ids) for x in r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        at = 0
        for t in r:
            n = len(t.input_ids)
            ids[i, at:at + n] = torch.tensor(t.input_ids)
            lab = list(t.labels)
            lab[0] = IGNORE
            labels[i, at:at + n] = torch.tensor(lab)
            pos[i, at:at + n] = torch.arange(n)
            at += n
        if at < width:  # padding continues as its own "example"
            pos[i, at:] = torch.arange(width - at)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (or HF_ENDPOINT) answers on port 443 within ``timeout`` seconds."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^https?://", "", endpoint).split("/")[0].split(":")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
