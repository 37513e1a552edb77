"""The output layer's side of the loss: digit logits from only the number-token rows of the output weight,
CE in checkpointed chunks (never the full [N, V] logits at once), and Liger's fused linear CE where it runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from delft.errors import UserError
from delft.losses.registry import fused_applies
from delft.losses.terms import compute_dtype
from delft.losses.triton_cpu import interpreter_on, patch_interpreter


def plain_linear(lm_head: nn.Module) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """(weight, bias) when lm_head is an ordinary float Linear; None for peft/bnb wrappers (use forward)."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(lm_head, nn.Linear) or not isinstance(weight, Tensor) or weight.ndim != 2:
        return None
    # bnb Linear4bit/8bit subclass nn.Linear but store packed integer weights
    if not weight.dtype.is_floating_point or type(weight) not in (Tensor, nn.Parameter):
        return None
    return weight, lm_head.bias


def digit_logits(hidden: Tensor, lm_head: nn.Module, digit_ids) -> Tensor:
    """[N, H] -> [N, 10] logits of '0'..'9', in fp32, from only the ten digit rows of the output weight."""
    ids = torch.as_tensor(digit_ids, device=hidden.device, dtype=torch.long)
    plain = plain_linear(lm_head)
    if plain is None:
        # peft LoRA on the output layer or a quantised head: no plain rows to slice, so run the module on
        # the (few) digit rows and keep ten columns. Costs N_digits x V, not N x V.
        return lm_head(hidden).index_select(-1, ids).to(compute_dtype(hidden.dtype))
    weight, bias = plain
    ct = compute_dtype(hidden.dtype)
    b = bias.index_select(0, ids).to(ct) if bias is not None else None
    return F.linear(hidden.to(ct), weight.index_select(0, ids).to(ct), b)


def _chunk_ce(lm_head: nn.Module, h: Tensor, t: Tensor) -> Tensor:
    logits = lm_head(h)
    return F.cross_entropy(logits.to(compute_dtype(logits.dtype)), t, reduction="sum")


def _chunk_dft(lm_head: nn.Module, h: Tensor, t: Tensor) -> Tensor:
    logits = lm_head(h)
    return dft_sum(logits.to(compute_dtype(logits.dtype)), t)


def dft_sum(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """DFT's sum over rows: -log p_y x sg(p_y), p_y = exp(-CE) of each row's label (ignored rows add 0): TRL's
    ``per_token_loss * log_probs.exp().detach()``, summed."""
    ce = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    return (ce * torch.exp(-ce).detach()).sum()


def chunked_ce_sum(hidden: Tensor, lm_head: nn.Module, targets: Tensor, chunk_size: int, dft: bool = False) -> Tensor:
    """Sum of CE (``dft``: of DFT's probability-weighted CE) over rows of hidden [N, H], never holding more than
    chunk_size x V logits.

    Each chunk is checkpointed, so backward recomputes its logits instead of keeping all of them alive.
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0  # in the graph, no NaN
    total = None
    recompute = torch.is_grad_enabled()
    chunk = _chunk_dft if dft else _chunk_ce
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]
        part = checkpoint(chunk, lm_head, h, t, use_reentrant=False) if recompute else chunk(lm_head, h, t)
        total = part if total is None else total + part
    return total


def liger_importable() -> bool:
    """liger-kernel and Triton import (they need no GPU to import; kernels need CUDA or the interpreter)."""
    try:
        import liger_kernel.transformers.fused_linear_cross_entropy  # noqa: F401
        return True
    except Exception:
        return False


def resolve_fused(mode: str, device) -> bool:
    """Whether to use Liger kernels (fused linear CE + layer kernels) on ``device``: delft.losses.registry.fused_applies
    with what this machine has; train.fused_loss 'on' that cannot be honoured is a UserError."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    fused, why = fused_applies(mode, cuda, mode != "off" and liger_importable(), interpreter_on())
    if why:
        raise UserError(f"train.fused_loss is 'on' but {why}",
                        fix="Set train.fused_loss: auto (falls back to chunked CE), or install liger-kernel "
                        "(pip install liger-kernel) on a CUDA machine.")
    if fused and not cuda:
        patch_interpreter()
    return fused


def liger_ce_sum(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor) -> Tensor:
    # Liger computes the CE gradient chunk by chunk in the forward pass, so the [N, V] logits never exist.
    # API: forward(lin_weight, _input, target, bias=None). Tested on the CPU under TRITON_INTERPRET=1.
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    out = LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, targets, bias)
    out = out[0] if isinstance(out, tuple) else out
    return out.float()
