"""The recipe's model, quantization and lora sections: which model, its weights' dtype and quantization, and the
LoRA adapter put on it; with the one rule for what quantization.mode auto means (``resolve_quantization``), which
training and the memory plan both follow."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from delft.recipe.section import Section

CHAR_TOKENIZER = "char"  # model.tokenizer: delft's character-level tokenizer (every digit one token)


class ArchitectureConfig(Section):
    """A Llama-style decoder built from random weights (model.init: scratch)."""

    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    layers: int = Field(4, gt=0, description="Decoder layers.")
    heads: int = Field(4, gt=0, description="Attention heads (hidden_size must divide by it).")
    kv_heads: Optional[int] = Field(None, gt=0, description="Key/value heads (grouped-query attention); unset: heads.")
    intermediate_size: int = Field(384, gt=0, description="Width of the SwiGLU MLP.")
    context: int = Field(128, gt=8, description="Most positions (data.max_length must fit in it).")
    tie_embeddings: bool = Field(True, description="Share the input embedding and the output layer (small models).")

    @model_validator(mode="after")
    def _shapes(self):
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not divide into {self.heads} heads")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} does not divide into {self.kv_heads} kv_heads")
        return self


class ModelConfig(Section):
    name: str = Field("smollm2-135m", description="Hub id, local directory, .gguf file, or the alias 'smollm2-135m' "
                      "(not read with init: scratch).")
    init: Literal["pretrained", "scratch"] = Field(
        "pretrained", description="pretrained: model.name's weights; scratch: random weights in the shape of "
        "model.architecture, trained from nothing (needs train.finetuning: full).")
    architecture: Optional[ArchitectureConfig] = Field(
        None, description="init: scratch only: the Llama-style shape (hidden_size, layers, heads, ...).")
    tokenizer: Optional[str] = Field(
        None, description=f"init: scratch only: '{CHAR_TOKENIZER}' (delft's character-level tokenizer: every digit, "
        "letter and sign one token; the default) or a tokenizer source (directory, hub id, 'smollm2-135m').")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' uses CUDA when present, else CPU.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/compute dtype; 'auto' = bf16 on CUDA (fp16 if unsupported), fp32 on CPU.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off: it runs arbitrary code).")
    adapter: Optional[str] = Field(None, description="A LoRA run directory (delft train's, or any peft adapter of "
                                   "this base model) to continue training, e.g. runs/sft before a GRPO stage; its "
                                   "rank and targets replace the lora section's.")

    @model_validator(mode="after")
    def _init(self):
        if self.init == "scratch":
            if self.adapter is not None:
                raise ValueError("init: scratch has no adapter to continue (drop model.adapter)")
            if self.architecture is None:
                object.__setattr__(self, "architecture", ArchitectureConfig())
            if self.tokenizer is None:
                object.__setattr__(self, "tokenizer", CHAR_TOKENIZER)
        elif self.architecture is not None or self.tokenizer is not None:
            raise ValueError("architecture and tokenizer only apply to init: scratch (a pretrained model has its own)")
        return self


class QuantizationConfig(Section):
    mode: Literal["auto", "nf4", "none"] = Field("auto", description="'auto' = nf4 on CUDA for LoRA (QLoRA), none "
                                                 "on CPU and with full fine-tuning.")
    double_quant: bool = Field(True, description="Quantise the nf4 scales too (saves ~0.4 bit/param).")
    kbit_upcast: bool = Field(
        False, description="Call peft's prepare_model_for_kbit_training (fp32 upcasts; costs much VRAM, see docs/gpu.md).")


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="'all-linear' (every linear projection except the output layer) or module names.")
    use_dora: bool = Field(False, description="DoRA (arXiv 2402.09353): a trained magnitude per output beside the "
                           "LoRA direction (peft's use_dora); merges like LoRA.")
    use_rslora: bool = Field(False, description="rsLoRA: scale alpha / sqrt(r) instead of alpha / r (steadier at "
                             "large ranks; peft's use_rslora).")
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained in full and saved with "
                                       "the adapter, e.g. [embed_tokens, lm_head] when new tokens are trained.")
    init: Literal["default", "gaussian", "pissa", "olora"] = Field(
        "default", description="peft's init_lora_weights: default (B = 0, A Kaiming), gaussian, pissa (the principal "
        "singular vectors, arXiv 2404.02948), olora (a QR of the weights); pissa and olora move the base weights, so "
        "the saved adapter is converted (rank 2r) to apply to the original base, as peft documents.")


MUTATING_INITS = ("pissa", "olora")  # they rewrite the base weights: saved adapters are converted back


def resolve_quantization(mode: str, device: str, finetuning: str = "lora", distributed: str = "ddp") -> str:
    """'auto' is nf4 for LoRA on CUDA (QLoRA), else none: full fine-tuning trains the weights themselves, and
    train.distributed fsdp shards plain weights (FSDP2 cannot shard bitsandbytes' packed nf4)."""
    if mode == "auto":
        return "nf4" if device == "cuda" and finetuning == "lora" and distributed != "fsdp" else "none"
    return mode
