"""Turning a recipe's model section into a tokenizer, a (quantised) model, LoRA, and loaded adapters."""

from __future__ import annotations

import gc
import json
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from delft import signals
from delft.errors import UserError
from delft.models.config_numbers import check_config_numbers
from delft.models.remote_code import check_remote_code
from delft.models.sources import ModelRef, resolve_model
from delft.rundir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MODEL_CONFIG,
    base_model,
    check_adapter_matches,
    check_model_files,
    check_trained_dir,
    has_adapter,
    is_merged_model,
    tokenizer_source,
)


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


def check_model_dir(path: Path, name: str, trust_remote_code: bool) -> None:
    """A local model directory refused by name before transformers reads it: a config number no model can have
    (first: its key named, not transformers' error), damaged or pickled files, code it would run untrusted."""
    check_config_numbers(path, "model.name")
    check_model_files(path, "model.name", "Restore or download the model again.")
    check_remote_code(path, name, "model.name", trust_remote_code)


def load_tokenizer(path: str, revision: Optional[str] = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if Path(path).is_dir():  # AutoTokenizer reads the directory's config.json too
        check_model_dir(Path(path), path, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load a tokenizer from {path}: {str(e).splitlines()[0]}", "model.name",
                        "Check that the directory or hub id holds a tokenizer.") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # training masks padding out of the loss; eval pads on the left
    return tok


def load_model(ref: ModelRef, device: str, dtype, quantization: str, double_quant: bool = True,
               revision: Optional[str] = None, trust_remote_code: bool = False, checked: bool = False):
    """The base model on ``device``; nf4 through bitsandbytes when asked (compute in ``dtype``). ``checked``: the
    caller has run ``check_model_dir`` on this directory with the same ``trust_remote_code`` (training's setup,
    when its tokenizer loaded), so it is not checked again."""
    import torch
    from transformers import AutoModelForCausalLM

    # use_safetensors: never a pickle (pytorch_model.bin), from a directory or from the hub
    kwargs = dict(dtype=dtype, revision=revision, trust_remote_code=trust_remote_code, use_safetensors=True)
    if ref.is_local and not checked:
        check_model_dir(Path(ref.path), ref.name, trust_remote_code)
    if quantization == "nf4":
        _check_cpu_nf4(ref, device)
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError as e:
            raise UserError(f"nf4 quantization needs bitsandbytes ({e})", "quantization.mode",
                            "pip install bitsandbytes, or set quantization.mode: none.") from None
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8)
        kwargs["device_map"] = {"": device if device == "cpu" else torch.cuda.current_device()}  # this rank's GPU
    try:
        with _report_held():
            model = AutoModelForCausalLM.from_pretrained(ref.path, **kwargs)
    except OSError as e:
        raise UserError(f"could not load model weights from {ref.path}: {str(e).splitlines()[0]}", "model.name",
                        "Check the path or hub id.") from None
    except RuntimeError as e:
        if "mismatch" not in str(e):
            raise
        detail = _first_mismatch(Path(ref.path)) if ref.is_local else ""
        raise UserError(f"the weights of {ref.name} do not have the shapes its {MODEL_CONFIG} describes"
                        f"{f' ({detail})' if detail else ''}: {Path(ref.path) / MODEL_CONFIG} does not belong to "
                        "these weights", "model.name", f"Restore the model's own {MODEL_CONFIG} (hidden_size, "
                        "num_hidden_layers, vocab_size, ... as it was trained), or download the model again.") from None
    if quantization != "nf4":
        model.to(device)
    else:
        keep_nf4_exact(model)
    return model


@contextmanager
def _report_held():
    """Hold transformers' log records while a model loads and let them out only if it loads: on weights that do
    not fit the config it logs a long table and then raises, and delft's refusal is one paragraph."""
    from transformers.utils import logging as hf_logging

    held: list = []

    def hold(record) -> bool:
        held.append(record)
        return False

    handlers = hf_logging.get_logger().handlers
    for h in handlers:
        h.addFilter(hold)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(hold)
    for record in held:  # only after a load that did not raise
        hf_logging.get_logger().handle(record)


def _first_mismatch(path: Path) -> str:
    """'NAME is [a, b] in FILE, [c, d] by config.json' for the first weight whose shape the config contradicts
    ("" when none is found): the model built on the meta device (no memory) against the safetensors headers."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            want = {k: list(v.shape) for k, v in
                    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path))).state_dict().items()}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    have = list(sf.get_slice(k).get_shape())
                    if k in want and want[k] != have:
                        return f"{k} is {have} in {f.name}, {want[k]} by {MODEL_CONFIG}"
    except Exception:  # the detail only: the refusal stands without it
        return ""
    return ""


def _check_cpu_nf4(ref: ModelRef, device: str) -> None:
    """bitsandbytes' native CPU dequantize_4bit decodes a weight wrongly when its input width is a multiple of 16
    but not of 64 (wrong block scales); delft has checked its CPU path on multiples of 64 only, so it refuses the
    rest rather than train on corrupted weights. And an older bitsandbytes has no CPU nf4 at all."""
    if device != "cpu":
        return
    check_bitsandbytes_cpu("quantization.mode nf4", "quantization.mode")
    if not ref.is_local:
        return
    cfg = json.loads((Path(ref.path) / MODEL_CONFIG).read_text())
    dims = {k: cfg.get(k) for k in ("hidden_size", "intermediate_size") if isinstance(cfg.get(k), int)}
    bad = {k: v for k, v in dims.items() if v % 64}
    if bad:
        raise UserError(f"nf4 on CPU needs layer widths that are multiples of 64, but this model has {bad}: "
                        "bitsandbytes' CPU kernels decode widths that are multiples of 16 but not of 64 (32, 48, 96, "
                        "160, ...) with wrong scales, and delft has checked the CPU path on multiples of 64 only",
                        "quantization.mode", "Use quantization.mode: none (or auto) on CPU, or train on a CUDA GPU.")


# The first bitsandbytes whose CPU path (nf4 quantise, dequantise and matmul; the 8-bit AdamW's kernels) delft has
# tested: 0.45 raises NotImplementedError for nf4 on the CPU and 0.48 has no native CPU kernels. pyproject.toml's
# floor is the same version (tests/training/test_bitsandbytes_cpu.py holds them together).
BNB_CPU_FLOOR = "0.50.2"


def bitsandbytes_version() -> Optional[str]:
    """The installed bitsandbytes' version (None: not installed), from its metadata: no import, so no torch."""
    from importlib import metadata

    try:
        return metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """'0.50.2' -> (0, 50, 2); a suffix (.dev0, rc1, +cpu) is ignored."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def bitsandbytes_line() -> str:
    """What ``delft --version`` says about bitsandbytes: its version, and whether delft runs it on the CPU."""
    have = bitsandbytes_version()
    if have is None:
        return "bitsandbytes not installed (nf4 and the 8-bit AdamW need it)"
    if release(have) < release(BNB_CPU_FLOOR):
        return f"bitsandbytes {have} (below {BNB_CPU_FLOOR}: nf4 and adamw_8bit are refused on the CPU; fine on CUDA)"
    return f"bitsandbytes {have}"


def check_bitsandbytes_cpu(what: str, where: str) -> None:
    """Refuse ``what`` (nf4, an 8-bit AdamW) on the CPU when bitsandbytes is missing or older than BNB_CPU_FLOOR."""
    have = bitsandbytes_version()
    if have is not None and release(have) >= release(BNB_CPU_FLOOR):
        return
    found = f"this environment has bitsandbytes {have}" if have else "bitsandbytes is not installed"
    raise UserError(f"{what} on the CPU needs bitsandbytes >= {BNB_CPU_FLOOR}, the first version whose CPU kernels "
                    f"delft has tested (0.45 has no CPU nf4, 0.48 no native CPU kernels), and {found}", where,
                    f"pip install 'bitsandbytes>={BNB_CPU_FLOOR}', or leave bitsandbytes out of CPU runs "
                    "(quantization.mode: none, train.optimizer: adamw).")


def check_eight_bit_on_cpu(optimizer: str) -> None:
    """An 8-bit AdamW on the CPU (the one copy of this refusal, which precheck and the optimizer's setup both call):
    paged_adamw_8bit refused, because bitsandbytes warns and runs it unpaged (there is no GPU memory to page out of)
    so the recipe would say something the run does not do; and a bitsandbytes below BNB_CPU_FLOOR refused."""
    if optimizer == "paged_adamw_8bit":
        raise UserError("train.optimizer paged_adamw_8bit pages its states out of GPU memory under pressure, and this "
                        "run is on the CPU, where bitsandbytes runs it unpaged: it is adamw_8bit there",
                        "train.optimizer", "Use train.optimizer: adamw_8bit on the CPU (the same 8-bit AdamW), or "
                        "adamw.")
    check_bitsandbytes_cpu(f"train.optimizer {optimizer}", "train.optimizer")


def nf4_layers(model) -> list:
    """(name, bitsandbytes Linear4bit) of every nf4 layer in ``model``; [] without importing bitsandbytes when
    nothing imported it (then no layer can be one)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def keep_nf4_exact(model) -> None:
    """Keep every nf4 layer on the path training differentiates through (dequantise, then matmul in the run's
    dtype). bitsandbytes 0.50 otherwise repacks a layer's weight into a CPU layout the first time it runs in eval
    mode on an input without gradient (validation, generation) on a CPU with AVX512-BF16; every later call, in
    training too, then goes to a bf16 kernel without autograd, so the LoRA layers below the top get wrong
    gradients, and converting back when saving changes the base weights."""
    for _, m in nf4_layers(model):
        m.support_avx512bf16_for_cpu = False


def _repacked(layer) -> bool:
    """Whether an nf4 layer's weight left the layout it was quantised in: bitsandbytes' flag for its CPU layout, or
    the weight no longer the [(N*K+1)//2, 1] bytes of quantize_4bit (whatever a later version calls its layout)."""
    state = layer.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        return True
    n, k = state.shape
    return tuple(layer.weight.shape) != ((n * k + 1) // 2, 1)


def check_nf4_exact(model) -> None:
    """After an evaluation: refuse to train on when bitsandbytes repacked an nf4 layer anyway (``keep_nf4_exact``
    turns it off by the attribute bitsandbytes 0.50 reads; a later version may read another)."""
    moved = [name for name, m in nf4_layers(model) if _repacked(m)]
    if moved:
        raise UserError(f"bitsandbytes {bitsandbytes_version()} moved {len(moved)} nf4 layers (the first: {moved[0]}) "
                        "to its CPU inference layout during an evaluation, which computes in bfloat16 without "
                        "gradients: training on would give the LoRA layers below the top wrong gradients",
                        "quantization.mode", f"Use bitsandbytes {BNB_CPU_FLOOR} (the version delft has checked), or "
                        "set quantization.mode: none on the CPU.")


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


LORA_INITS = {"default": True, "gaussian": "gaussian", "pissa": "pissa", "olora": "olora"}  # lora.init -> peft's


def save_initial_adapter(model, path: Path) -> None:
    """The adapter as a pissa/olora init left it, before any step: what peft's conversion subtracts at save time
    (``save_pretrained(..., path_initial_model_for_weight_conversion=path)``), saved as a plain LoRA init."""
    config = model.peft_config["default"]
    init = config.init_lora_weights
    config.init_lora_weights = True  # so that the saved initial adapter reads as a standard one (peft's recipe)
    try:
        model.save_pretrained(str(path))
    finally:
        config.init_lora_weights = init


def apply_lora(model, lora_cfg, gradient_checkpointing: bool, kbit_upcast: bool = False):
    """Wrap in peft LoRA. Checkpointing needs input grads, or LoRA + checkpointing silently trains nothing."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if kbit_upcast:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    _prepare_for_training(model, gradient_checkpointing, input_grads=True)
    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=lora_cfg.target_modules, task_type="CAUSAL_LM", use_dora=lora_cfg.use_dora,
                        use_rslora=lora_cfg.use_rslora, modules_to_save=lora_cfg.modules_to_save or None,
                        init_lora_weights=LORA_INITS[lora_cfg.init])
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UserError(f"LoRA could not be applied: {e}", "lora.target_modules",
                        "Use 'all-linear' or names of linear modules in this model.") from None


def _prepare_for_training(model, gradient_checkpointing: bool, input_grads: bool) -> None:
    """Gradient checkpointing (non-reentrant) and no KV cache. ``input_grads`` for a frozen base under an adapter:
    without gradients at the embedding output, checkpointing + LoRA silently trains nothing."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if input_grads:
            model.enable_input_require_grads()
    model.config.use_cache = False


def make_trainable(model, gradient_checkpointing: bool):
    """Every weight trainable (train.finetuning: full); checkpointing as for LoRA (the embeddings train, so the
    checkpointed layers get input gradients without help)."""
    _prepare_for_training(model, gradient_checkpointing, input_grads=False)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def plain_model(model):
    """The transformers model under a peft wrapper (or the model itself, fully fine-tuned)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def continue_lora(model, adapter: str, gradient_checkpointing: bool, base: str):
    """Wrap in the trainable LoRA adapter saved in ``adapter`` (model.adapter: continue a run's training)."""
    from peft import PeftModel

    path = Path(adapter).expanduser()
    if check_trained_dir(path, "model.adapter") != "adapter":
        raise UserError(f"model.adapter {adapter} holds a merged model, not a LoRA adapter", "model.adapter",
                        "Give a run directory with adapter_config.json (or set model.name to the merged model).")
    check_adapter_matches(path, base, model.config, "model.adapter")
    _prepare_for_training(model, gradient_checkpointing, input_grads=True)
    return PeftModel.from_pretrained(model, str(path), is_trainable=True)


@contextmanager
def last_hidden_states(model):
    """Capture the decoder's output (the last hidden states, after the final norm) during one forward:
    ``with last_hidden_states(model) as (captured, head): model(...)``, then ``captured["hidden"]``."""
    captured: dict = {}

    def hook(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    decoder, head = decoder_and_head(model)
    handle = decoder.register_forward_hook(hook)
    try:
        yield captured, head
    finally:
        handle.remove()


def decoder_and_head(model):
    """The transformer body (returns hidden states after the final norm) and the output layer.

    Calling the body directly lets the losses use only the rows/positions they need instead of
    full-vocabulary logits for every position.
    """
    base = plain_model(model)
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


@dataclass
class Loaded:
    """A model loaded for inference and its tokenizer; ``model`` is None once ``using_model`` has freed it."""

    model: Any
    tokenizer: Any


@contextmanager
def using_model(base: Optional[str], adapter: Optional[str] = None, device: str = "auto",
                dtype: str = "auto") -> Iterator[Loaded]:
    """Load a model (``load_for_inference``), hand it over, and free it when the block ends, whatever happens.

    The block reaches the model only through the yielded ``Loaded``, whose reference is dropped on the way out,
    so its memory is returned before the next model loads (eval, inspect and the GGUF check load several)."""
    model, tokenizer = load_for_inference(base, adapter, device=device, dtype=dtype)
    loaded = Loaded(model, tokenizer)
    del model
    try:
        yield loaded
    finally:
        loaded.model = None
        free_memory()
    signals.check()  # between two models: a Ctrl-C lost in a finalizer still stops the command


def free_memory() -> None:
    """Return a dropped model's memory (the caller deletes its last reference first)."""
    import torch

    with signals.held():  # a signal raised inside a finalizer the pass runs would be lost
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
