"""Training over a split sequence: each rank's slice of a batch, the exact global loss, grad sums.

With the sequence split over ``cp`` ranks, every rank computes the loss of its own tokens.
The global mean is the sum of token losses all-reduced over ``cp`` divided by the global
count of counted tokens (``context_parallel_loss``); its backward is local, so each rank's
parameter gradients are partial and are summed over ``cp`` (``sync_context_parallel_grads``),
exactly as data parallelism sums over ``dp``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Group, all_reduce, group_rank, group_size, reduce_from_region
from tessera.tensor_parallel.context.layout import Layout, split_sequence

__all__ = ["context_parallel_loss", "split_batch", "sync_context_parallel_grads"]


def split_batch(
    *tensors: Tensor, group: Group, layout: Layout | str = Layout.CONTIGUOUS, dim: int = 1
) -> tuple[Tensor, ...]:
    """This rank's slice of the sequence (along ``dim``) of each full-batch tensor (ids, targets, masks)."""
    cp, rank = group_size(group), group_rank(group)
    return tuple(split_sequence(t, rank, cp, layout, dim).contiguous() for t in tensors)


def context_parallel_loss(
    logits: Tensor, targets: Tensor, group: Group, *, ignore_index: int = -100
) -> Tensor:
    """Mean cross-entropy over every rank's tokens of the split sequence, the same on every rank.

    Moves one all-reduce of a scalar (the loss sum; backward: identity, each rank's gradient
    is its own tokens' share) and one of the token count (no gradient).
    """
    total = F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    count = all_reduce((targets != ignore_index).sum().to(total.dtype), group)
    return reduce_from_region(total, group) / count.clamp_min(1)


def sync_context_parallel_grads(model: nn.Module | Iterable[nn.Parameter], group: Group) -> int:
    """Sum every parameter gradient over ``group`` in place; return how many were summed.

    One all-reduce per dtype of the flattened gradients (moves 2x their bytes). A training
    loop that already sums gradients over a data-parallel group spanning dp x cp needs no call.
    """
    params = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = all_reduce(torch.cat([g.reshape(-1) for g in same]), group, inplace=True)
        for g, part in zip(same, flat.split_with_sizes([g.numel() for g in same]), strict=True):
            g.copy_(part.view_as(g))
    return len(grads)
