"""The per-position digit terms, one function per loss type, registered by name (``@term_of``): each maps ten
digit logits z [N, 10], gold digits y [N] and place weights w [N] to a term per position [N]. Computed in fp32
(fp64 kept), and written so that a digit far ahead of the others loses neither value nor gradient.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from delft.losses.registry import LOSS_TYPES


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, fp64 kept (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _prep(z: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    z = z.to(compute_dtype(z.dtype))
    return z, y.to(device=z.device, dtype=torch.long)


TermFn = Callable[..., Tensor]


TERMS: dict[str, TermFn] = {}  # loss type name (delft.losses.registry.LOSS_TYPES) -> per-position term


def term_of(name: str):
    """Register a per-position term function for the loss type ``name``."""
    if name not in LOSS_TYPES or not LOSS_TYPES[name].has_term:
        raise ValueError(f"{name!r} is not a digit-term type of delft.losses.registry.LOSS_TYPES")

    def register(fn: TermFn) -> TermFn:
        TERMS[name] = fn
        return fn
    return register


@term_of("del")
def del_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """DEL: w * mean_k p_k * BCEWithLogits(z_k, 1[k == y]); p not detached (reference code)."""
    z, y = _prep(z, y)
    p = torch.softmax(z, dim=-1)
    b = F.binary_cross_entropy_with_logits(z, F.one_hot(y, 10).to(z.dtype), reduction="none")
    # mean over k here, so a mean over positions equals the mean over all N x 10 entries
    return w.to(z) * (p * b).mean(dim=-1)


@term_of("del_prob")
def del_prob_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """w * mean_k sg(p_k) * BCE(p_k, 1[k == y]), p = softmax over the ten digits, sg = detach.

    Shift-invariant (p is). Gradient, with c_k = w sg(p_k) / 10:
        dL/dz_y = -c_y (1 - p_y) - sum_{k != y} c_k p_k p_y / (1 - p_k)  < 0  for every z,
    so descent always raises the correct digit; at equal logits (p = 0.1) it is -w / 100.
    """
    z, y = _prep(z, y)
    log_p = torch.log_softmax(z, dim=-1)
    hit = F.one_hot(y, 10).to(torch.bool)
    bce = -torch.where(hit, log_p, log_miss(z))
    return w.to(z) * (log_p.exp().detach() * bce).mean(dim=-1)


def log_miss(z: Tensor) -> Tensor:
    """log(1 - p_k) for every k of z [N, 10]: logsumexp of the other nine logits minus logsumexp of all ten.

    Exact where p_k rounds to 1. The usual log(-expm1(log p_k)) cancels there: log p_k loses its digits once a
    wrong digit is ~15 nats ahead (fp32), and the correct digit's gradient is cut when it is needed most.
    """
    others = z.unsqueeze(-2).expand(*z.shape[:-1], 10, 10)
    eye = torch.eye(10, dtype=torch.bool, device=z.device)
    return torch.logsumexp(others.masked_fill(eye, float("-inf")), dim=-1) - torch.logsumexp(z, dim=-1, keepdim=True)


def expected(z: Tensor, values: Tensor) -> Tensor:
    """E_p[values] over the digit softmax of z [N, 10], values [N, 10], centred on the most likely digit's value.

    The same number as (softmax(z) * values).sum(-1), but its gradient p_j (v_j - E[v]) no longer subtracts two
    nearly equal numbers when one digit holds almost all the mass (autograd's softmax backward would).
    """
    anchor = values.gather(-1, z.argmax(dim=-1, keepdim=True))
    return (torch.softmax(z, dim=-1) * (values - anchor)).sum(dim=-1) + anchor.squeeze(-1)


@term_of("del_centered")
def del_centered_term(z: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """w * mean_k sg(p_k) * BCEWithLogits(z_k - mean_j z_j, 1[k == y]): the reference's binary CE per candidate
    on logits centred over the ten digits, weight detached.

    Shift-invariant (centring removes a common offset). With u = z - mean z, s = sigmoid, c_k = w sg(p_k) / 10:
        dL/dz_y = 0.9 c_y (s(u_y) - 1) - 0.1 sum_{k != y} c_k s(u_k)  < 0  for every z.
    """
    z, y = _prep(z, y)
    u = z - z.mean(dim=-1, keepdim=True)
    b = F.binary_cross_entropy_with_logits(u, F.one_hot(y, 10).to(z.dtype), reduction="none")
    return w.to(z) * (torch.softmax(z, dim=-1).detach() * b).mean(dim=-1)


@term_of("ntl_was")
def ntl_was_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None) -> Tensor:
    """NTL-WAS: sum_k p_k |k - y| (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    return expected(z, (k - y.to(z.dtype)[:, None]).abs())


@term_of("ntl_mse")
def ntl_mse_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None) -> Tensor:
    """NTL-MSE: (sum_k p_k k - y)^2 (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    return (expected(z, k.expand_as(z)) - y.to(z.dtype)) ** 2


@term_of("dist2")
def dist2_term(z: Tensor, y: Tensor, w: Optional[Tensor] = None, tau: float = 1.0) -> Tensor:
    """DIST2: KL(q || p), q_k proportional to exp(-(k - y)^2 / tau) (w unused)."""
    z, y = _prep(z, y)
    k = torch.arange(10, device=z.device, dtype=z.dtype)
    log_q = torch.log_softmax(-((k - y.to(z.dtype)[:, None]) ** 2) / tau, dim=-1)
    return (log_q.exp() * (log_q - torch.log_softmax(z, dim=-1))).sum(dim=-1)
