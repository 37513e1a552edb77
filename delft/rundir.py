"""The run directory's contract: what `delft train` writes and eval, inspect, export and compare read.

A run directory holds a peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``; or, fully
fine-tuned, the whole model: ``config.json`` + ``model.safetensors``), the tokenizer, the resolved ``recipe.yaml``, ``delft_run.json`` (status, base model and its shapes, data
counts, step), ``metrics.jsonl``, ``snapshots/step-N/`` (train.snapshot_steps) and, while training, ``checkpoints/step-N/``. A merged model directory
(from `delft export`) has a ``config.json`` and no adapter. Every name and status lives here, once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from delft.errors import UserError
from delft.outputs import remove, remove_dead_leftovers, write_atomic

RUN_INFO = "delft_run.json"
RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
LOSS_CURVE = "loss_curve.png"
CHECKPOINTS = "checkpoints"
CHECKPOINT_PREFIX = "step-"
SNAPSHOTS = "snapshots"  # train.snapshot_steps: the model kept at those steps, for learning curves
STATE_FILE = "trainer_state.pt"  # optimizer, scheduler, RNG states of a checkpoint
HF_STATE_FILE = "trainer_state.json"  # the same in a checkpoint of transformers' Trainer (train.stage grpo)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MODEL_CONFIG = "config.json"
EXPORT_INFO = "delft_export.json"  # in every `delft export` output: what export --force may replace
LOCK_FILE = ".delft.lock"  # held while a training writes the directory (delft.training.lock)

RUNNING, INTERRUPTED, COMPLETED = "running", "interrupted", "completed"






# ----------------------------------------------------------------------------- run info


def read_info(run_dir: Path) -> dict:
    """``delft_run.json`` as a dict ({} when absent); a corrupt file is a clear error, not a traceback."""
    path = Path(run_dir) / RUN_INFO
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})", str(run_dir),
                        f"Restore {RUN_INFO} from a backup, or train the run again into a new directory.") from None
    if not isinstance(info, dict):
        raise UserError(f"{path} does not hold a JSON object", str(run_dir),
                        f"Restore {RUN_INFO} from a backup, or train the run again into a new directory.")
    return info


def metrics_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order ([] when absent); a line cut short or damaged (a run killed while
    writing it) is skipped, so the whole rows around it still count."""
    path = Path(run_dir) / METRICS
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def write_info(run_dir: Path, info: dict) -> None:
    write_atomic(Path(run_dir) / RUN_INFO, json.dumps(info, indent=2))


def start_info(run_dir: Path, *, stage: str, base_model: str, base_model_path: str, architecture: dict,
               quantization: str, finetuning: str, init: str, continued_from: Optional[str], loss: str,
               loss_weight: float, loss_path: Optional[str], step: int, total_steps: int, liger_kernels: list,
               data: dict, world_size: int) -> None:
    """``delft_run.json`` of a run that starts or resumes (status running): every stage records these same keys,
    which eval, inspect, export and compare read; the checkpoints, the end and a stop update it (``update_info``)."""
    write_info(run_dir, {
        "status": RUNNING, "stage": stage, "base_model": base_model, "base_model_path": base_model_path,
        "architecture": architecture, "quantization": quantization, "finetuning": finetuning, "init": init,
        "continued_from": continued_from, "loss": loss, "loss_weight": loss_weight, "loss_path": loss_path,
        "step": step, "total_steps": total_steps, "liger_kernels": liger_kernels, "data": data,
        "world_size": world_size})


def update_info(run_dir: Path, **changes) -> dict:
    info = read_info(run_dir)
    info.update(changes)
    write_info(run_dir, info)
    return info


def status(run_dir: Path) -> Optional[str]:
    return read_info(run_dir).get("status")


# ----------------------------------------------------------------------------- what a directory is


def has_files(path: Path) -> bool:
    """Anything in ``path`` besides the training lock (which a fresh run makes before anything else)."""
    path = Path(path)
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


def clear(run_dir: Path) -> None:
    """Empty a run directory for --force, keeping the directory and its lock file: the lock belongs to the
    directory's inode, so deleting the directory would free it for another training while this one runs."""
    for p in Path(run_dir).iterdir():
        if p.name != LOCK_FILE:
            remove(p)


def remove_run_leftovers(run_dir: Path) -> list[Path]:
    """What a killed training left half-written in a run directory (a checkpoint, a snapshot, a log rewrite):
    the temporaries of processes that are gone, removed. Only in a delft run directory."""
    if not is_run_dir(run_dir):
        return []
    run_dir = Path(run_dir)
    return [p for d in (run_dir, run_dir / CHECKPOINTS, run_dir / SNAPSHOTS) for p in remove_dead_leftovers(d)]


def is_run_dir(path: Path) -> bool:
    """Written by `delft train` (finished or not): the only kind of directory `train --force` may replace."""
    return (Path(path) / RUN_INFO).is_file()


def has_adapter(path: Path) -> bool:
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and any((path / f).is_file() for f in ADAPTER_WEIGHTS)


def is_merged_model(path: Path) -> bool:
    """A standalone model directory (e.g. from `delft export`): config.json and no adapter."""
    path = Path(path)
    return path.is_dir() and (path / MODEL_CONFIG).is_file() and not (path / ADAPTER_CONFIG).is_file()


def check_trained_dir(path: Path, where: str, merged: bool = True) -> str:
    """Refuse, by name and before any model loads, what is not a trained model directory: a missing path, a file,
    a directory with no adapter (nor, with ``merged``, a merged model), or one with a damaged weight file.
    Returns "adapter" or "merged". The one check eval, inspect and export run on the directories they are given."""
    path = Path(path)
    what = "a run directory written by `delft train`" + (" or a merged model from `delft export`" if merged else "")
    if not path.exists():
        raise UserError(f"run directory {path} does not exist", where, f"Give {what}.")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a run directory", where, f"Give {what}.")
    if has_adapter(path):
        kind = "adapter"
    elif merged and is_merged_model(path):
        kind = "merged"
    else:
        status = read_info(path).get("status")
        hint = (f" (its {RUN_INFO} says status {status!r}: finish or resume the training first)"
                if status not in (None, COMPLETED) else "")
        model = f" nor a merged model ({MODEL_CONFIG})" if merged else ""
        raise UserError(f"{path} holds no adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS[0]}){model}{hint}", where,
                        f"Give {what}.")
    check_model_files(path, where, "Restore the file, or train (or export) that run again.")
    return kind


def is_finished_run(path: Path) -> bool:
    """A completed `delft train` run: its adapter, or (fully fine-tuned) its model, at the top."""
    path = Path(path)
    return path.is_dir() and (has_adapter(path) or is_merged_model(path)) and status(path) == COMPLETED


def base_model(run_dir: Path) -> Optional[str]:
    """The base model a run records (delft_run.json), else the adapter's own base_model_name_or_path."""
    recorded = read_info(run_dir).get("base_model")
    if isinstance(recorded, str) and recorded:
        return recorded
    try:
        cfg = json.loads((Path(run_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    named = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    return named if isinstance(named, str) and named else None  # a number there is refused by check_adapter_config


def tokenizer_source(run_dir: Optional[Path], base_path: str) -> str:
    """Where to load the tokenizer: the run's own copy (saved at the end of training), else the base model's."""
    if run_dir is not None and any(Path(run_dir).glob("tokenizer*")):
        return str(run_dir)
    return base_path


def check_model_files(path: Path, where: str, fix: str) -> None:
    """Refuse a damaged adapter or model directory before any long work: its JSON configs must parse (and say what
    peft and transformers accept), its weights must be safetensors, and every safetensors file must have a whole
    header covering the file (an adapter cut short fails here, by name)."""
    from safetensors import safe_open

    path = Path(path)
    for name in (ADAPTER_CONFIG, MODEL_CONFIG):
        if (path / name).exists():
            data = read_json(path / name, where, fix)
            (check_adapter_config if name == ADAPTER_CONFIG else check_model_config)(path / name, data, where)
    check_safetensors_only(path, where)
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                sf.keys()
        except Exception as e:  # safetensors' own error type, or an OSError
            raise _damaged(f, e, where, fix) from None


def read_json(file: Path, where: str, fix: str) -> dict:
    """A JSON object from ``file`` (a model's or adapter's config); anything else is a UserError naming it."""
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise _damaged(Path(file), e, where, fix) from None
    if not isinstance(data, dict):
        raise _damaged(Path(file), ValueError("not a JSON object"), where, fix)
    return data


def _damaged(file: Path, err: Exception, where: str, fix: str) -> UserError:
    reason = (str(err).splitlines() or [type(err).__name__])[0][:160]
    return UserError(f"{file} is damaged or unreadable ({reason})", where, fix)


# ----------------------------------------------------------------------------- what a model file must say

# Weights in pickle files: loading one can run code, so delft reads none (safetensors only).
PICKLE_WEIGHTS = ("pytorch_model*.bin", "adapter_model.bin", "model*.pt", "model*.pth", "consolidated*.pth")


def _names(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# adapter_config.json's fields peft reads when it loads a LoRA adapter: (accepts, what it must be). None is allowed
# where peft allows it (every field but r, lora_alpha and peft_type).
ADAPTER_FIELDS = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a whole number above 0, e.g. 8"),
    "lora_alpha": (_number, "a number, e.g. 16"),
    "peft_type": (lambda v: isinstance(v, str), 'text, e.g. "LORA"'),
    "lora_dropout": (lambda v: v is None or (_number(v) and 0 <= v < 1), "a number from 0 up to 1, e.g. 0.05"),
    "target_modules": (lambda v: v is None or _names(v), 'a module name or a list of them, e.g. ["q_proj", "v_proj"]'),
    "modules_to_save": (lambda v: v is None or _names(v), 'a list of module names, e.g. ["lm_head"]'),
    "base_model_name_or_path": (lambda v: v is None or isinstance(v, str), "the base model's name or path as text"),
    "task_type": (lambda v: v is None or isinstance(v, str), 'text, e.g. "CAUSAL_LM"'),
    "bias": (lambda v: v is None or isinstance(v, str), 'text, e.g. "none"'),
    "use_dora": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "use_rslora": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "fan_in_fan_out": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "rank_pattern": (lambda v: v is None or isinstance(v, dict), "an object of module names and ranks"),
    "alpha_pattern": (lambda v: v is None or isinstance(v, dict), "an object of module names and alphas"),
    "layers_to_transform": (lambda v: v is None or isinstance(v, int) or (isinstance(v, list) and all(
        isinstance(x, int) for x in v)), "a layer number or a list of them"),
}


def check_adapter_config(file: Path, data: dict, where: str) -> None:
    """Refuse an adapter_config.json whose fields peft would trip over (``r: "eight"``, ``target_modules: 5``)."""
    bad = [f"{k} is {json.dumps(data[k])[:60]}, but must be {want}" for k, (ok, want) in ADAPTER_FIELDS.items()
           if k in data and not ok(data[k])]
    bad += [f"{k} is missing" for k in ("r", "lora_alpha") if data.get("peft_type", "LORA") == "LORA" and k not in data]
    if bad:
        raise UserError(f"{file} is not a LoRA adapter config peft can load: {'; '.join(bad)}", where,
                        f"Correct it in {file.name} (delft train writes these fields; a hand-edited or foreign "
                        "adapter may have them wrong), or train the adapter again.")


def check_model_config(file: Path, data: dict, where: str) -> None:
    """Refuse a config.json transformers rejects (an unknown model_type, a value its config class cannot take), by
    name, before any weights load. A type transformers lacks but ``auto_map`` code provides is left to the
    remote-code check: transformers builds such a config only by running that code."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' typed configs raise it for a wrong type
    from transformers import CONFIG_MAPPING, AutoConfig, __version__

    model_type = data.get("model_type")
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if not known and "auto_map" in data:
        return
    if "model_type" in data and not known:
        raise UserError(f"{file} names model_type {json.dumps(model_type)[:60]}, which transformers {__version__} "
                        "does not know", where, f"Correct model_type in {file.name} (e.g. \"llama\", \"qwen2\"), or, "
                        "for a model newer than this transformers, upgrade it: pip install -U transformers.")
    try:
        AutoConfig.from_pretrained(str(Path(file).parent), trust_remote_code=False)
    except (ValueError, TypeError, KeyError, AttributeError, OSError, StrictDataclassError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"transformers cannot read {file} ({reason})", where,
                        f"Restore {file.name} from where the model came from, or download the model again.") from None


def check_safetensors_only(path: Path, where: str) -> None:
    """Refuse a directory whose weights are only in pickle files (pytorch_model.bin, adapter_model.bin): delft
    loads safetensors only, since unpickling a file someone else made can run their code. Says how to convert."""
    pickles = sorted({f.name for pattern in PICKLE_WEIGHTS for f in Path(path).glob(pattern)})
    if not pickles or any(Path(path).glob("*.safetensors")):
        return
    d = str(path)
    if "adapter_model.bin" in pickles:
        how = ("python -c \"import torch; from safetensors.torch import save_file; save_file(torch.load("
               f"'{d}/adapter_model.bin', weights_only=True), '{d}/adapter_model.safetensors')\"")
    else:
        how = ("python -c \"from transformers import AutoModelForCausalLM as M; "
               f"M.from_pretrained('{d}').save_pretrained('{d}')\" (it writes model.safetensors beside the .bin)")
    raise UserError(f"{Path(path) / pickles[0]} holds the weights as a pickle file{'s' if len(pickles) > 1 else ''} "
                    f"({', '.join(pickles)}), and delft loads safetensors only: loading a pickle can run code "
                    "hidden in it", where, f"Convert it once, on a machine where you trust the file: {how}.")


# ----------------------------------------------------------------------------- checkpoints


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint or snapshot directory (``step-000042``, ``step-1000000``) holds. Compare
    checkpoints by this, never by name: past step 999,999 the names outgrow their six-digit padding, and
    ``step-1000000`` sorts before ``step-999000``."""
    return int(Path(path).name.removeprefix(CHECKPOINT_PREFIX))


def _is_step_name(name: str) -> bool:
    digits = name.removeprefix(CHECKPOINT_PREFIX)
    return name.startswith(CHECKPOINT_PREFIX) and digits.isascii() and digits.isdigit()


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first by step (a checkpoint is complete once its state file is in place)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [c for c in root.glob(f"{CHECKPOINT_PREFIX}*")
             if _is_step_name(c.name) and ((c / STATE_FILE).is_file() or (c / HF_STATE_FILE).is_file())]
    return sorted(found, key=checkpoint_step)


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / SNAPSHOTS / f"{CHECKPOINT_PREFIX}{step:06d}"


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = checkpoints(run_dir)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- adapter and base


def architecture(config) -> dict:
    """What an adapter must match: the shapes its weights were trained against."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
    return {k: getattr(config, k, None) for k in keys}


def check_adapter_matches(run_dir: Path, base: str, base_config, where: str) -> None:
    """An adapter only fits the base whose shapes it was trained on (recorded in delft_run.json by train)."""
    info = read_info(Path(run_dir))
    expected, actual = info.get("architecture"), architecture(base_config)
    if expected and expected != actual:
        diff = ", ".join(f"{k} {expected[k]} vs {actual.get(k)}" for k in expected if expected[k] != actual.get(k))
        raise UserError(f"the adapter in {run_dir} was trained on {info.get('base_model')!r}, whose shapes "
                        f"differ from {base!r} ({diff})", where,
                        f"Use the base model it was trained on ({info.get('base_model')}; see {run_dir}/{RUN_INFO}).")
