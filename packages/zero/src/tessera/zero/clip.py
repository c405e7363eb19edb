"""Global gradient norm and overflow detection over gradient shards held by different ranks.

Each rank holds a disjoint shard of the flat gradients, so the norm of the whole model's
gradient is the square root of the sum over ranks of the squared norms of their shards; one
all-reduce of two float64 numbers (squared norm, non-finite flag) moves 32 bytes by the
paper accounting and gives every rank the same norm and the same overflow verdict. Clipping
with it equals ``torch.nn.utils.clip_grad_norm_`` on the whole model (same coefficient
``max_norm / (norm + 1e-6)``, clamped to 1). Under plain data parallelism (stage 0) every
rank holds the whole averaged gradient already: nothing is summed over the data-parallel
group, only over the model-parallel ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tessera.comm import Group, all_reduce
from tessera.zero.flat import FlatLayout

__all__ = ["GradStats", "clip_coefficient", "global_grad_stats", "shard_weights"]


@dataclass(frozen=True, slots=True)
class GradStats:
    """The global gradient 2-norm and whether any rank saw a non-finite gradient."""

    norm: float
    overflow: bool


def shard_weights(layout: FlatLayout, rank: int, weights: Sequence[float]) -> list[tuple[int, int, float]]:
    """The ``[start, stop)`` pieces of ``rank``'s shard (shard-local offsets) whose tensors
    have a weight other than 1 in the squared norm, with that weight."""
    lo, hi = layout.shard_range(rank)
    pieces = []
    for i, w in enumerate(weights):
        start, stop = layout.span(i)
        a, b = max(start, lo), min(stop, hi)
        if w != 1.0 and a < b:
            pieces.append((a - lo, b - lo, w))
    return pieces


def _local_sq(
    grads: Sequence[Tensor], weights: Sequence[list[tuple[int, int, float]] | None] | None
) -> tuple[float, bool]:
    if not grads:
        return 0.0, False
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), 2.0).float().cpu() for g in grads])
    sq = float(torch.sum(norms.double() ** 2))
    for g, pieces in zip(grads, weights or [None] * len(grads), strict=True):
        for a, b, w in pieces or ():
            part = float(torch.linalg.vector_norm(g.detach()[a:b].double(), 2.0)) ** 2
            sq += (w - 1.0) * part
    return sq, not math.isfinite(sq)


def global_grad_stats(
    grads: Sequence[Tensor],
    group: Group,
    device: torch.device,
    *,
    extra_groups: Sequence[Group] = (),
    weights: Sequence[list[tuple[int, int, float]] | None] | None = None,
    replicated: bool = False,
) -> GradStats:
    """All-reduce the squared norm of this rank's gradient shards and its overflow flag.

    ``device`` is where the collective runs (the group's device: gradients offloaded to the
    host are reduced through it). ``extra_groups``: model-parallel groups summed over too;
    ``weights``: per gradient, shard pieces counted with a weight (see ``shard_weights``).
    ``replicated``: the gradients are identical on every rank of ``group`` (stage 0), so only
    ``extra_groups`` are summed over. Moves 32 bytes per group summed over.
    """
    sq, bad = _local_sq(grads, weights)
    return reduce_grad_stats(sq, bad, group, device, extra_groups=extra_groups, replicated=replicated)


def reduce_grad_stats(
    sq: float,
    bad: bool,
    group: Group,
    device: torch.device,
    *,
    extra_groups: Sequence[Group] = (),
    replicated: bool = False,
) -> GradStats:
    """The global norm and overflow flag from this rank's squared norm ``sq`` and non-finite
    flag ``bad`` (one all-reduce of 32 bytes per group summed over; see ``global_grad_stats``)."""
    stats = torch.tensor([0.0 if bad else sq, 1.0 if bad else 0.0], dtype=torch.float64, device=device)
    total = stats if replicated else all_reduce(stats, group, "sum", inplace=True)  # stats: ours
    for extra in extra_groups:
        total = all_reduce(total, extra, "sum", inplace=True)
    total = total.cpu()
    overflow = bool(total[1] > 0)
    return GradStats(norm=math.inf if overflow else math.sqrt(float(total[0])), overflow=overflow)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` scales gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))
