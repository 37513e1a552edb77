"""Helpers shared by the test modules (tiny models are in tiny.py, fixtures in conftest.py).

Test modules import from here, never from one another.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import yaml
from torch import Tensor

from delft.errors import UserError
from delft.numbers.digits import DIGITS, place_weight, run_places
from delft.numbers.tokens import IGNORE

# Small slices of the real benchmark files (GSM8K test split, SVAMP), same formats, so the tests need no
# ../shared beside the checkout. Sources and licenses: tests/data/README.md.
DATA = Path(__file__).resolve().parent / "data"
REPO = Path(__file__).resolve().parent.parent  # the checkout: recipes/, docs/, README.md


# The optional extras (README: "Two optional steps"), the module each test of one needs, and its install command.
EXTRAS = {
    "gguf": ("llama_cpp", 'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install -e ".[gguf]"'),
    "axolotl": ("axolotl.integrations.base", 'pip install --no-deps "axolotl==0.19.0" addict'),
}
SKIPPED_EXTRA = "optional extra ["  # how a skip for a missing extra starts: found again in strict mode


def extra_missing(extra: str) -> str:
    """Why the extra's tests cannot run here ("" when its module imports)."""
    module, command = EXTRAS[extra]
    try:
        import_module(module)
    except Exception as e:  # installed but broken (a protobuf clash, a missing library) counts as missing
        return f"{SKIPPED_EXTRA}{extra}] is not usable here ({type(e).__name__}: {e}); install it with: {command}"
    return ""


def write_yaml(path: Path, data: dict) -> Path:
    """``data`` as YAML at ``path`` (parents created); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def recipe_file(tmp_path: Path, model_dir: Path, name="run", **sections) -> Path:
    """A recipe for a few-step LoRA run of ``model_dir`` on synthetic sums, written to ``tmp_path/name.yaml``.

    ``sections`` update the defaults per section, e.g. ``train={"max_steps": 30}``.
    """
    base = {
        "model": {"name": str(model_dir)},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.1},
        "data": {"synthetic": {"n": 48, "max_digits": 2}, "max_length": 40, "val_size": 8},
        "train": {"max_steps": 6, "batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1, "eval_steps": 3,
                  "save_steps": 3, "warmup_ratio": 0.0},
        "output": {"dir": str(tmp_path / name)},
    }
    if sections.get("train", {}).get("finetuning") == "full" and "lora" not in sections:
        del base["lora"]  # full fine-tuning refuses lora keys (it would ignore them)
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return write_yaml(tmp_path / f"{name}.yaml", base)


def write_arms(rec: Path, model_dir: Path, runs: Path, **sections) -> Path:
    """A recipes folder for compare and study: ``base.yaml`` (a 2-step LoRA run of ``model_dir`` on tiny synthetic
    sums) and ``ce.yaml`` / ``del.yaml`` on it, differing only in their loss, run in ``runs/<name>-seed0``.
    ``sections`` update the base's sections, e.g. ``eval={"limit": 2}``. Returns ``rec``."""
    base = {
        "model": {"name": str(model_dir)},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"synthetic": {"n": 24, "max_digits": 2}, "max_length": 40, "val_size": 4},
        "train": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1, "eval_steps": 2,
                  "save_steps": 10, "warmup_ratio": 0.0},
        "eval": {"batch_size": 4, "bootstrap": 10},
        "output": {"dir": str(runs / "base-seed0")},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    write_yaml(rec / "base.yaml", base)
    for name in ("ce", "del"):
        write_yaml(rec / f"{name}.yaml", {"base": "base.yaml", "loss": {"type": name},
                                          "output": {"dir": str(runs / f"{name}-seed0")}})
    return rec


def adapter_weights(run_dir: Path) -> dict:
    """The adapter tensors a run saved, by name."""
    from safetensors.torch import load_file

    from delft.rundir import ADAPTER_WEIGHTS

    return load_file(str(run_dir / ADAPTER_WEIGHTS[0]))


def assert_same_after_adam(got: Tensor, expected: Tensor, lr: float, steps: int, rtol: float, atol: float,
                           what: str = "") -> None:
    """Weights of two runs that differ only in float summation order (one process, or an all-reduce of two halves).
    Adam divides each gradient by its running RMS, so an element whose gradient is near zero can step the other way
    on a rounding-sized difference: by at most 2 x lr per step. Every other element must match to (rtol, atol); at
    most one element in 10,000 (and at least one allowed) may differ, within that bound."""
    off = ~torch.isclose(got, expected, rtol=rtol, atol=atol)
    allowed = max(1, got.numel() // 10_000)
    assert int(off.sum()) <= allowed, f"{what}: {int(off.sum())} of {got.numel()} elements differ (at most {allowed})"
    worst = float((got - expected).abs().max())
    assert worst <= 2 * lr * steps + atol, f"{what}: a difference of {worst:.3g}, more than Adam's 2 x lr x steps"


def lora_run(model_dir: Path, run_dir: Path, targets=("q_proj", "v_proj"), r: int = 4, alpha: int = 8,
             seed: int = 1, info: bool = True) -> Path:
    """A run directory as `delft train` leaves it, without training: a peft adapter whose B is non-zero (so it
    changes the model), and with ``info`` the run info (completed, base model, architecture) and the recipe."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from delft.recipe.files import dump_recipe
    from delft.recipe.schema import validate_recipe
    from delft.rundir import COMPLETED, RECIPE, architecture, write_info

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  init_lora_weights=False))
    run_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(run_dir)
    if info:
        write_info(run_dir, {"status": COMPLETED, "base_model": str(model_dir),
                             "architecture": architecture(model.config)})
        (run_dir / RECIPE).write_text(dump_recipe(validate_recipe(
            {"model": {"name": str(model_dir)}, "output": {"dir": str(run_dir)}})))
    return run_dir


def refused(r, *words: str) -> None:
    """Exit 2, no traceback, and the message says every one of ``words``."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output, r.output
    text = " ".join(r.output.split())
    for w in words:
        assert w in text, (w, r.output)


def run_cli(*args, **invoke):
    """``delft <args>`` in-process through typer's CliRunner (arguments str()-ed, so Paths may be passed); the
    click Result: exit_code, output (stdout and stderr), exception. ``invoke`` goes to CliRunner.invoke
    (``env``, ``input``, ``catch_exceptions``; its defaults otherwise, as every test used them)."""
    from typer.testing import CliRunner

    from delft.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], **invoke)


@contextmanager
def read_only_dir(path: Path):
    """``path`` (created) made unwritable for this process, root included: mode 0555, and ``chattr +i`` where root
    and the filesystem allow it. Skips the test where neither takes."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o555)
    immutable = (os.geteuid() == 0 and shutil.which("chattr") is not None
                 and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0)
    try:
        try:
            tempfile.TemporaryFile(dir=path).close()
        except OSError:
            yield path
        else:
            pytest.skip("cannot make a directory read-only here")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        os.chmod(path, 0o755)


def del_step(vocab, hidden, head, labels, fused: bool):
    """One DEL micro-batch through delft.losses.loss.Loss on the fused (Liger) or chunked CE path, backward taken:
    (its Sums, the gradients of ``hidden`` and of ``head.weight``); checks the path that ran."""
    from delft.losses.loss import Loss

    hidden.grad, head.weight.grad = None, None
    loss = Loss("del", 0.3, vocab, chunk_size=5, fused=fused)
    out = loss.sums(hidden, head, labels)
    loss.combine(out, out.counts).backward()
    assert loss.path_ran == ("fused_linear_ce" if fused else "chunked_ce")
    return out, hidden.grad.clone(), head.weight.grad.clone()


# ------------------------------------------------------------------- the single-digit oracle of the losses


class DigitTargets(NamedTuple):
    mask: Tensor     # [B, T] bool: label is a digit; hidden[mask] / logits[mask] give the N rows, row-major
    targets: Tensor  # [N] long, digit value 0..9
    weights: Tensor  # [N] float32, DEL place weight


def digit_targets(labels: Tensor, vocab: "OracleDigits", weigh: Callable[[int], float] = place_weight) -> DigitTargets:
    """Digit positions, their values and DEL place weights (``weigh(place)``); runs are found per sequence."""
    rows = labels.tolist()
    mask = [[False] * labels.shape[-1] for _ in rows]
    targets: list[int] = []
    weights: list[float] = []
    for b, row in enumerate(rows):
        for t, place in enumerate(vocab.places(row)):
            if place is None:
                continue
            mask[b][t] = True
            targets.append(int(vocab.char_of(row[t])))
            weights.append(weigh(place))
    dev = labels.device
    return DigitTargets(torch.tensor(mask, dtype=torch.bool, device=dev).reshape(labels.shape),
                        torch.tensor(targets, dtype=torch.long, device=dev),
                        torch.tensor(weights, dtype=torch.float32, device=dev))


def count_items(labels: Tensor, vocab: Optional["OracleDigits"]) -> tuple[int, int]:
    """(labelled positions, digit-labelled positions): the trainer's denominators for a whole optimizer batch.

    Every digit label gets a place in digits.py, so counting digit ids equals len(digit_targets(...).targets).
    The oracle that numtokens.count_digit_chars is checked against.
    """
    n_labels = int((labels != IGNORE).sum())
    if vocab is None:
        return n_labels, 0
    ids = torch.tensor(vocab.digit_ids, device=labels.device)
    return n_labels, int(torch.isin(labels, ids).sum())


@dataclass(frozen=True)
class OracleDigits:
    """The test oracle's single-digit vocabulary, probed independently of delft.numbers.tokens.NumberVocab:
    token ids of '0'..'9' (in order) and of '.', found in a tokenizer."""

    digit_ids: tuple[int, ...]
    dot_id: Optional[int]
    comma_id: Optional[int] = None  # the thousands separator: "1,234" is one number (delft.numbers.digits)

    @classmethod
    def from_tokenizer(cls, tokenizer, purpose: str = "a digit loss") -> "OracleDigits":
        """Find the single-token digits; refuse tokenizers that chunk numbers (Llama-3, GPT-4 style)."""
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        ids = []
        for d in DIGITS:
            enc = tokenizer.encode(d, add_special_tokens=False)
            toks = [t for t in enc if tokenizer.decode([t]).strip() != ""]
            if len(toks) != 1 or tokenizer.decode(toks).strip() != d:
                raise UserError(
                    f"tokenizer {name!r} does not encode the digit {d!r} as one token (got {enc}), so {purpose} "
                    "is undefined for it", fix="Use a model whose tokenizer splits numbers into single digits "
                    "(Qwen2/2.5, SmolLM2, Llama-2, Mistral) or set loss.type: ce.")
            ids.append(toks[0])
        chunked = tokenizer.encode("1234567890", add_special_tokens=False)
        chunked = [t for t in chunked if tokenizer.decode([t]).strip() != ""]
        if chunked != [ids[int(c)] for c in "1234567890"]:
            raise UserError(
                f"tokenizer {name!r} merges digits into multi-digit tokens ('1234567890' -> {len(chunked)} tokens, "
                f"not 10), so {purpose} is undefined for it", fix="Use a model whose tokenizer splits numbers "
                "into single digits (Qwen2/2.5, SmolLM2, Llama-2, Mistral) or set loss.type: ce.")
        dot = [t for t in tokenizer.encode(".", add_special_tokens=False) if tokenizer.decode([t]) != ""]
        dot_id = dot[0] if len(dot) == 1 and tokenizer.decode(dot) == "." else None
        comma = [t for t in tokenizer.encode(",", add_special_tokens=False) if tokenizer.decode([t]) != ""]
        return cls(tuple(ids), dot_id, comma[0] if len(comma) == 1 and tokenizer.decode(comma) == "," else None)

    def char_of(self, token_id: int) -> Optional[str]:
        if token_id in self._lookup:
            return self._lookup[token_id]
        return None

    @property
    def _lookup(self) -> dict[int, str]:
        table = self.__dict__.get("_table")
        if table is None:
            table = {t: d for d, t in zip(DIGITS, self.digit_ids)}
            if self.dot_id is not None:
                table[self.dot_id] = "."
            if self.comma_id is not None:
                table[self.comma_id] = ","
            object.__setattr__(self, "_table", table)
        return table

    def places(self, token_ids: Sequence[int]) -> list[Optional[int]]:
        """Places of a token sequence; ignored labels (-100) and other tokens end runs."""
        return run_places([self.char_of(int(t)) for t in token_ids])


def oracle_digits(numbers) -> OracleDigits:
    """The oracle's vocabulary with the digit ids of a (single-digit) delft NumberVocab."""
    return OracleDigits(tuple(numbers.digit_ids), numbers.dot_id, numbers.comma_id)


def varied_reward(completions, **kwargs):
    """A TRL reward function for tiny random-init models, which are never right: distinct characters, so rewards
    vary within a group and GRPO has advantages to learn from (grpo.reward_functions: ['helpers:varied_reward'])."""
    return [float(len(set(str(c)))) for c in completions]


def interrupt_on_step(monkeypatch, n: int):
    """Make the trainer's n-th optimizer step raise KeyboardInterrupt (Ctrl-C inside a step); returns a function
    that puts the real step back, for the resume."""
    import delft.training.sft as train_mod

    real, calls = train_mod.optimizer_step, {"n": 0}

    def interrupting(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "optimizer_step", interrupting)
    return lambda: monkeypatch.setattr(train_mod, "optimizer_step", real)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a rendezvous the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
