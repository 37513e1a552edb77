"""What a run needs before its first step: device, tokenizer, digit vocabulary, the loss built from the recipe,
the datasets, the model (with its LoRA adapter, or every weight trainable) and the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console

from delft.data.pipeline import build_datasets
from delft.errors import UserError
from delft.losses.loss import Loss
from delft.losses.registry import FUSED_CE, GLOBAL
from delft.models.context import check_max_length
from delft.models.loading import (
    apply_liger_layers,
    apply_lora,
    check_eight_bit_on_cpu,
    continue_lora,
    load_model,
    load_tokenizer,
    make_trainable,
    resolve_device,
    resolve_dtype,
)
from delft.models.scratch import recipe_model_ref
from delft.numbers.tokens import NumberVocab
from delft.recipe.schema import Recipe
from delft.recipe.train_section import EIGHT_BIT_OPTIMIZERS
from delft.training import distributed as dist
from delft.training.precheck import named_folder


@dataclass
class Setup:
    """Everything a run needs, built from the recipe (tokenizer, data and loss before any weights load)."""

    recipe: Recipe
    device: str
    quantization: str
    tokenizer: object
    loss: object  # delft.losses.loss.Loss
    train: list
    val: list
    stats: object
    model_ref: object


def setup(recipe: Recipe) -> Setup:
    device = resolve_device(recipe.model.device)
    quant = recipe.quantization_on(device)
    ref = recipe_model_ref(recipe)
    if recipe.model.init != "scratch" and ref.is_local and not named_folder(recipe):
        # a model that became a folder here (the hub's cache, an alias, a GGUF file): its config.json, before
        # weights; a folder model.name names was checked before loading (delft.training.precheck, which train and
        # recipe check run first), and is not read again
        check_max_length(recipe.data.max_length, Path(ref.path), recipe.model.name)
    # checks a local folder (delft.models.loading.check_model_dir) once, for the tokenizer and the weights
    tokenizer = load_tokenizer(ref.path, recipe.model.revision, recipe.model.trust_remote_code)
    if recipe.loss.type != "ce":  # single digits or number tokens of 1-3 digits (Llama-3); glued digits refused
        vocab = NumberVocab.from_tokenizer(tokenizer, purpose=f"loss.type {recipe.loss.type!r}")
    else:
        try:
            vocab = NumberVocab.from_tokenizer(tokenizer)
        except UserError:
            vocab = None  # CE needs no digit tokens; counts are just not reported
    loss = Loss.from_recipe(recipe, vocab, device, dist.world_size())
    train, val, stats = build_datasets(recipe.data, tokenizer, recipe.train.seed,
                                       set(vocab.ids) if vocab else None, completions=recipe.train.stage == "sft")
    return Setup(recipe, device, quant, tokenizer, loss, train, val, stats, ref)


def build_model(s: Setup, console: Console, dtype: Optional[torch.dtype] = None):
    """(model with LoRA or every weight trainable, dtype, Liger layer kernels applied: [] or ["rms_norm", "swiglu",
    "rope"]). ``dtype``: the weights' (the placement's choice; default the recipe's model.dtype on the device)."""
    r = s.recipe
    dtype = dtype or resolve_dtype(r.model.dtype, s.device)
    torch.manual_seed(r.train.seed)  # LoRA's A matrices are random: same seed, same init
    model = load_model(s.model_ref, s.device, dtype, s.quantization, r.quantization.double_quant,
                       r.model.revision, r.model.trust_remote_code, checked=True)  # by load_tokenizer in setup
    kernels = apply_liger_layers(model) if s.loss.fused else []
    if s.loss.fused:
        console.print(f"[bold]kernels[/] Liger {', '.join([FUSED_CE] + kernels)}")
    if r.train.finetuning == "full":
        model = make_trainable(model, r.train.gradient_checkpointing)
    elif r.model.adapter:
        model = continue_lora(model, r.model.adapter, r.train.gradient_checkpointing, r.model.name)
    else:
        model = apply_lora(model, r.lora, r.train.gradient_checkpointing, r.quantization.kbit_upcast)
    model.train()  # HF skips gradient checkpointing in eval mode (docs/gpu.md: 25 GiB instead of 8.6)
    return model, dtype, kernels


def build_optimizer(s: Setup, params: list, dtype):
    """The recipe's optimizer over ``params``: torch's AdamW in fp32; bitsandbytes' 32-bit AdamW for bf16/fp16
    weights (full fine-tuning on CUDA), so the moments stay fp32 beside 16-bit weights; bitsandbytes' 8-bit AdamW
    (paged on CUDA only; on the CPU from the bitsandbytes delft has tested there); torch's SGD."""
    t = s.recipe.train
    if t.optimizer in EIGHT_BIT_OPTIMIZERS and s.device == "cpu":
        check_eight_bit_on_cpu(t.optimizer)
    common = dict(lr=t.learning_rate, weight_decay=t.weight_decay)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, momentum=t.momentum, **common)
    if t.optimizer == "adamw" and dtype == torch.float32:
        return torch.optim.AdamW(params, betas=t.betas, **common)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise UserError(f"train.optimizer {t.optimizer} with {str(dtype).replace('torch.', '')} weights needs "
                        f"bitsandbytes ({e})", "train.optimizer", "pip install bitsandbytes, or set model.dtype: "
                        "float32.") from None
    if t.optimizer == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, betas=t.betas, **common)
    if t.optimizer == "paged_adamw_8bit":
        return bnb.optim.PagedAdamW8bit(params, betas=t.betas, **common)
    return bnb.optim.AdamW(params, betas=t.betas, optim_bits=32, **common)


def build_scheduler(recipe: Recipe, optimizer, warmup_steps: int, total_steps: int):
    """transformers' schedule of the recipe: cosine, linear, constant (after warmup) or warmup-stable-decay."""
    from transformers import get_scheduler

    t = recipe.train
    if t.lr_scheduler == "wsd":
        decay = max(1, round(t.decay_ratio * total_steps))
        return get_scheduler("warmup_stable_decay", optimizer, num_warmup_steps=warmup_steps,
                             num_training_steps=total_steps,
                             scheduler_specific_kwargs={"num_decay_steps": decay,
                                                        "num_stable_steps": max(0, total_steps - warmup_steps - decay)})
    name = "constant_with_warmup" if t.lr_scheduler == "constant" else t.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)


def describe(s: Setup, model, dtype, console: Console) -> None:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    st = s.stats
    chosen = "(auto)" if s.recipe.quantization.mode == "auto" else ""
    name = "from scratch" if s.recipe.model.init == "scratch" else s.recipe.model.name
    console.print(f"[bold]model[/] {name} {('- ' + s.model_ref.note) if s.model_ref.note else ''}")
    r = s.recipe
    how = ("full fine-tuning" if r.train.finetuning == "full" else
           f"LoRA continued from {r.model.adapter}" if r.model.adapter else f"LoRA r={r.lora.r}")
    threads = torch.get_num_threads()  # as precheck chose it (delft.training.precheck.thread_choice)
    where = f"cpu ({threads} thread{'s' if threads > 1 else ''})" if s.device == "cpu" else s.device
    console.print(f"  device {where}, dtype {str(dtype).replace('torch.', '')}, quantization {s.quantization} "
                  f"{chosen}, {how}: {trainable:,} trainable of {total:,} parameters")
    console.print(f"[bold]data[/] {st.examples} examples -> {st.train} train / {st.val} validation; "
                  f"{st.label_tokens:,} trainable labels, {st.digit_labels:,} digit labels "
                  f"({st.digit_labels / max(1, st.label_tokens):.0%})")
    if st.truncated:
        console.print(f"  [yellow]{st.truncated} examples were truncated to data.max_length={s.recipe.data.max_length}[/]")
    if st.empty:
        console.print(f"  [yellow]{st.empty} examples had an empty completion (only the end-of-sequence token to "
                      "learn) and were dropped[/]")
    if st.fully_masked:
        console.print(f"  [yellow]{st.fully_masked} examples had no trainable label and were dropped[/]")
    lt = s.recipe.loss
    term = "none" if lt.type == "ce" else "none, each label's CE weighted by its detached probability (dft)" \
        if lt.type == "dft" else f"{lt.type} x {lt.weight:g}"
    how = ("each a mean over the optimizer batch" if lt.normalisation == GLOBAL else
           f"the reference's scaling: term a mean per micro-batch x {s.recipe.train.grad_accum} micro-batches")
    console.print(f"[bold]loss[/] CE + {term} ({how})")
