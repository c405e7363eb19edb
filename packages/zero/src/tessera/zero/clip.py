"""Global gradient norm and overflow detection over gradient shards held by different ranks.

Each rank holds a disjoint shard of the flat gradients, so the norm of the whole model's
gradient is the square root of the sum over ranks of the squared norms of their shards; one
all-reduce of two float64 numbers (squared norm, non-finite flag) moves 32 bytes by the
paper accounting and gives every rank the same norm and the same overflow verdict. Clipping
with it equals ``torch.nn.utils.clip_grad_norm_`` on the whole model (same coefficient
``max_norm / (norm + 1e-6)``, clamped to 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tessera.comm import Group, all_reduce

__all__ = ["GradStats", "clip_coefficient", "global_grad_stats"]


@dataclass(frozen=True, slots=True)
class GradStats:
    """The global gradient 2-norm and whether any rank saw a non-finite gradient."""

    norm: float
    overflow: bool


def _local_sq(grads: Sequence[Tensor]) -> tuple[float, bool]:
    if not grads:
        return 0.0, False
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), 2.0).float().cpu() for g in grads])
    sq = float(torch.sum(norms.double() ** 2))
    return sq, not math.isfinite(sq)


def global_grad_stats(grads: Sequence[Tensor], group: Group, device: torch.device) -> GradStats:
    """All-reduce the squared norm of this rank's gradient shards and its overflow flag.

    ``device`` is where the collective runs (the group's device: gradients offloaded to the
    host are reduced through it). Moves 32 bytes.
    """
    sq, bad = _local_sq(grads)
    stats = torch.tensor([0.0 if bad else sq, 1.0 if bad else 0.0], dtype=torch.float64, device=device)
    total = all_reduce(stats, group, "sum").cpu()
    overflow = bool(total[1] > 0)
    return GradStats(norm=math.inf if overflow else math.sqrt(float(total[0])), overflow=overflow)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` scales gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))
