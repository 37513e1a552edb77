"""From a recipe's data section to training and validation sets: load the examples (file, hub or generator),
split off validation, tokenize, and count what was kept."""

from __future__ import annotations

import random
import stat
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from delft.data.batches import tokenize_example
from delft.data.columns import check_columns_present
from delft.data.generated import nupa_examples, reasoning_gym_examples, synthetic_examples
from delft.data.sources import Example, is_data_file, load_rows, row_to_example
from delft.errors import UserError
from delft.numbers.tokens import IGNORE


def load_examples(cfg, where: str = "data", exclude: Collection[str] = frozenset()) -> list[Example]:
    """The data section's examples (its first ``limit``). A generated source skips every problem whose normalised
    prompt (delft.data.sources.normalised_prompt) is in ``exclude`` and draws on in its place, so an eval set
    holds no training problem and keeps its size; a file or hub set is taken as given (its training problems
    are counted by the commands that score it, not removed)."""
    if cfg.format == "synthetic":
        examples = synthetic_examples(cfg.synthetic, exclude, cfg.limit, where)
    elif cfg.format == "reasoning_gym":
        examples = reasoning_gym_examples(cfg.reasoning_gym, where, exclude, cfg.limit)
    elif cfg.format == "nupa":
        examples = nupa_examples(cfg.nupa, exclude, cfg.limit, where)
    else:
        examples = _read_examples(cfg, where)
    if not examples:
        raise UserError("the data source gave no examples", f"{where}.source", "Check the file and data.limit.")
    return examples


# A data file is read and parsed once per process, whoever asks: delft train's checks before loading
# (delft.training.precheck), its setup, the held-out slice and the contamination counts each want the same
# examples. Handing the parsed list from the checks to setup instead would thread data through the run lifecycle
# (delft.training.stages, run and every stage's load), which knows nothing of data, and would still miss the
# readers beside it; keyed here, every reader shares one parse. The key is what decides the examples: the file as
# it is on disk (resolved path, device, inode, size, modification and change times in ns, so a file rewritten or
# replaced in between is read again) and the section's format, columns and limit. A few files are kept (a
# training and an eval file, a comparison's): their examples stay in memory beside the tokens built from them.
_PARSED: OrderedDict = OrderedDict()
PARSED_KEPT = 4


def _file_key(cfg) -> Optional[tuple]:
    """What decides a local data file's examples, or None for a hub set or a path that is not a regular file (read
    as before, and refused by what it is)."""
    if not is_data_file(cfg.source):
        return None
    path = Path(cfg.source).expanduser()
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    columns = tuple(sorted(cfg.columns.items())) if cfg.columns else None
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, cfg.format,
            columns, cfg.limit)


def _read_examples(cfg, where: str) -> list[Example]:
    """A file's or hub set's examples (its first ``cfg.limit``); a local file's parsed once (``_PARSED``)."""
    key = _file_key(cfg)  # taken before the read: a file changed while it is read is read again next time
    if key in _PARSED:
        _PARSED.move_to_end(key)
        return list(_PARSED[key])  # a list of its own; the examples themselves are never changed in place
    rows, label = load_rows(cfg, where)
    check_columns_present(rows, cfg.columns, label, where)
    examples = [row_to_example(r, cfg.format, i, label, where, cfg.columns) for i, r in enumerate(rows[: cfg.limit])]
    if key is not None and examples:
        _PARSED[key] = examples
        while len(_PARSED) > PARSED_KEPT:
            _PARSED.popitem(last=False)
    return list(examples)


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
    empty: int = 0  # examples with nothing to learn but the end-of-sequence token (empty_example)
    notes: list[str] = field(default_factory=list)


def _blank(text) -> bool:
    if isinstance(text, list):  # chat messages
        return all(_blank(m.get("content", "")) for m in text)
    return not str(text).strip()


def empty_example(ex: Example, cfg) -> bool:
    """Whether training on ``ex`` would learn the end-of-sequence token alone: an empty (or blank) completion,
    unless data.train_on_prompt trains on a prompt that has text."""
    return _blank(ex.completion) and (not cfg.train_on_prompt or _blank(ex.prompt))


def check_not_all_empty(examples: list[Example], cfg, where: str = "data") -> None:
    """Refuse data whose every example is empty (empty_example): it would train on the end-of-sequence token alone
    and report 0 digit labels, saying nothing else. ``delft recipe check`` calls it too."""
    if examples and all(empty_example(ex, cfg) for ex in examples):
        both = all(_blank(ex.prompt) for ex in examples)
        what = "prompt and completion are" if both else "completion is"
        raise UserError(f"every one of the {len(examples)} examples of {cfg.source} has nothing to learn: its {what} "
                        "empty, so training would learn the end-of-sequence token alone", f"{where}.source",
                        "Check that data.format matches the file's fields (a prompt_completion file needs a "
                        "non-empty completion in each row), or point data.source at the right file.")


def build_datasets(cfg, tokenizer, seed: int, digit_ids: Optional[set] = None, where: str = "data",
                   completions: bool = True):
    """Tokenize every example, drop (and count) empty ones (empty_example; only where the completions are what is
    learned, not under GRPO, which learns from rewards) and ones with no trainable label, split off validation."""
    examples = load_examples(cfg, where)
    if completions:
        check_not_all_empty(examples, cfg, where)
    stats = DataStats(examples=len(examples))
    items = []
    for ex in examples:
        if completions and empty_example(ex, cfg):
            stats.empty += 1
            continue
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
