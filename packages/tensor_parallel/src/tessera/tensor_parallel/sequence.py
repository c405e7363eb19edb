"""Entering and leaving the tensor-parallel region, with and without sequence parallelism.

Without sequence parallelism the tensors between transformer sublayers (residual stream,
LayerNorm, dropout) are replicated on every tp rank: a sublayer enters the region with
Megatron's f (``copy_to_region``: nothing forward, all-reduce of the gradient backward) and
leaves it with g (``reduce_from_region``: all-reduce forward).

With sequence parallelism (Megatron-style) those tensors hold this rank's 1/tp slice of the
sequence: a sublayer enters with an all-gather along the sequence (reduce-scatter of the
gradient backward) and leaves with a reduce-scatter along it (all-gather backward). Each
all-reduce becomes an all-gather plus a reduce-scatter: the same bytes moved by the paper
accounting (an all-reduce of S counts 2S, either half S).

The parameters of LayerNorms (and the biases added after a reduce-scatter) in the sequence
region are replicated, but each rank sees only its tokens, so their gradients are partial:
``sync_sequence_parallel_grads`` sums them over the tp group before the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from tessera.comm import (
    Group,
    all_gather_along,
    all_reduce,
    copy_to_region,
    reduce_from_region,
    reduce_scatter_along,
    split_along,
)

__all__ = [
    "enter_tp_region",
    "exit_tp_region",
    "is_sequence_parallel",
    "mark_sequence_parallel",
    "scatter_to_sequence",
    "sequence_parallel_params",
    "sync_sequence_parallel_grads",
]

_MARK = "tessera_sequence_parallel"


def enter_tp_region(
    x: Tensor, group: Group, *, sequence_parallel: bool, seq_dim: int = -2, private: bool = False
) -> Tensor:
    """Hand a replicated (or, with SP, sequence-sharded) ``x`` to the column-parallel layers.

    Moves nothing forward and all-reduces the gradient (2x ``x``) backward; with SP
    all-gathers ``x`` along ``seq_dim`` forward (the full tensor) and reduce-scatters the
    gradient backward. ``private``: the result feeds only linear layers (each makes a new
    input gradient), so the gradient is all-reduced in place (``copy_to_region``'s
    ``grad_inplace``) instead of into a copy."""
    if sequence_parallel:
        return all_gather_along(x, seq_dim, group)
    return copy_to_region(x, group, grad_inplace=private)


def exit_tp_region(
    x: Tensor, group: Group, *, sequence_parallel: bool, seq_dim: int = -2, private: bool = False
) -> Tensor:
    """Sum the row-parallel layers' partial outputs: all-reduce (2x ``x``), or with SP
    reduce-scatter along ``seq_dim`` (``x``); backward: nothing, or an all-gather.
    ``private``: ``x`` is a temporary nothing else reads, all-reduced in place."""
    if sequence_parallel:
        return reduce_scatter_along(x, seq_dim, group)
    return reduce_from_region(x, group, inplace=private)


def scatter_to_sequence(x: Tensor, group: Group, *, seq_dim: int = -2) -> Tensor:
    """Keep this rank's slice of a replicated ``x`` along ``seq_dim`` (nothing moved forward;
    the gradient is all-gathered backward, so a replicated producer gets its whole gradient)."""
    return split_along(x, seq_dim, group)


def mark_sequence_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag a replicated parameter whose gradient is partial per rank under SP."""
    setattr(param, _MARK, True)
    return param


def is_sequence_parallel(param: Tensor) -> bool:
    """Whether ``param`` was tagged by ``mark_sequence_parallel``."""
    return bool(getattr(param, _MARK, False))


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The tagged parameters of ``model``, each once, in ``parameters()`` order."""
    return [p for p in model.parameters() if is_sequence_parallel(p)]


def sync_sequence_parallel_grads(model: nn.Module | Iterable[nn.Parameter], group: Group) -> int:
    """Sum the gradients of the SP-tagged parameters over ``group``, in place; return how many.

    One all-reduce per (dtype, device) of the flattened gradients (moves 2x their bytes).
    Call it after backward and before the optimizer step (and after the last micro-batch
    when accumulating: the sum is linear). Every rank must hold gradients for the same
    parameters, as it does when all ranks run the same model.
    """
    params = sequence_parallel_params(model) if isinstance(model, nn.Module) else list(model)
    grads = [p.grad for p in params if is_sequence_parallel(p) and p.grad is not None]
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        all_reduce(flat, group, inplace=True)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
