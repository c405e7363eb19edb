"""The router's auxiliary losses: load balancing (Switch / GShard) and z-loss (ST-MoE)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["load_balancing_loss", "z_loss"]


def load_balancing_loss(probs: Tensor, routed: Tensor) -> Tensor:
    """``E * sum_e f_e * P_e``: ``f_e`` the fraction of the ``T * k`` assignments that chose
    expert ``e`` (``routed [E]``, counted before capacity drops; not differentiable), ``P_e``
    the mean router probability of ``e`` over the ``T`` tokens (``probs [T, E]``). Equals 1
    when routing is uniform; 0 for no tokens."""
    tokens, experts = probs.shape
    if tokens == 0:
        return probs.sum()
    f = routed.to(probs.dtype) / routed.sum()
    return experts * torch.dot(f, probs.mean(dim=0))


def z_loss(logits: Tensor) -> Tensor:
    """Mean over tokens of ``logsumexp(logits)**2`` (in fp32); 0 for no tokens."""
    if logits.shape[0] == 0:
        return logits.float().sum()
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
