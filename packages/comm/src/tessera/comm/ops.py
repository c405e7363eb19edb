"""Differentiable collectives: the conjugate pairs that tensor and sequence parallelism use.

Each op is a small autograd Function wrapped in a typed function. The backward of each is
the adjoint of its forward for the way parallel layers use it:

=========================  ======================================  ===================================
op                         forward                                 backward
=========================  ======================================  ===================================
copy_to_region (f)         identity                                all-reduce (sum)
reduce_from_region (g)     all-reduce (sum)                        identity
split_along                keep this rank's chunk along ``dim``    all-gather along ``dim``
gather_along               all-gather along ``dim``                keep this rank's chunk
all_gather_along           all-gather along ``dim``                reduce-scatter along ``dim``
reduce_scatter_along       reduce-scatter along ``dim``            all-gather along ``dim``
all_to_all_along           all-to-all, scatter ``s``, gather ``g``  all-to-all, scatter ``g``, gather ``s``
broadcast_from             broadcast from ``src``                  sum of gradients to ``src``, 0 elsewhere
=========================  ======================================  ===================================

``gather_along`` suits a replicated consumer (every rank computes the same thing from the
gathered tensor, so each holds the whole gradient); ``all_gather_along`` a consumer whose
work differs per rank (sequence parallelism), whose partial gradients must be summed.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from tessera.comm import collectives as C
from tessera.comm.collectives import Group
from tessera.comm.eager import never_compiled

__all__ = [
    "all_gather_along",
    "all_to_all_along",
    "broadcast_from",
    "copy_to_region",
    "gather_along",
    "reduce_from_region",
    "reduce_scatter_along",
    "split_along",
]


@never_compiled
def apply_function(fn: type[torch.autograd.Function], *args: object) -> Tensor:
    """``fn.apply(*args)`` for a Function whose forward returns one tensor, typed: the one
    typed entry to autograd Functions for every package (``Function.apply`` is untyped).

    Never traced by torch.compile (`tessera.comm.eager`): a compiled caller breaks its graph
    here and the Function (its collectives, shared memory, locks) runs eagerly, forward and
    backward, as it does uncompiled."""
    return cast(Tensor, fn.apply(*args))  # type: ignore[no-untyped-call]  # torch: Function.apply is unannotated


def _own_chunk(x: Tensor, dim: int, group: Group) -> Tensor:
    n = C.group_size(group)
    if n == 1:
        return x
    if x.dim() == 0 or x.shape[dim] % n:
        raise ValueError(
            f"split_along: size of dim {dim} in shape {tuple(x.shape)} is not divisible by the group size {n}"
        )
    return x.chunk(n, dim=dim)[C.group_rank(group)].contiguous()


def _owned(t: Tensor) -> bool:
    """Whether an in-place all-reduce may write into ``t``: contiguous, not a view of another
    tensor (whose other parts someone may hold), not a leaf that requires grad."""
    return t.is_contiguous() and t._base is None and not (t.is_leaf and t.requires_grad)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, grad_inplace: bool) -> Tensor:
        ctx.group, ctx.grad_inplace = group, grad_inplace
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # a linear consumer's input gradient is a new matmul output, or (inputs of more than two
        # dims) a reshaped view of one: the caller's promise covers both, so views qualify here
        inplace = ctx.grad_inplace and grad.is_contiguous()
        return C.all_reduce(grad, ctx.group, inplace=inplace), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: Group, inplace: bool) -> Tensor:
        if inplace and _owned(x):
            ctx.mark_dirty(x)
            return C.all_reduce(x, group, inplace=True)
        return C.all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return C.all_gather(grad, ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Group, sum_grads: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.sum_grads = dim, group, sum_grads
        return C.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.sum_grads:
            return C.reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _own_chunk(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return C.reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return C.all_gather(grad, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter_dim: int, gather_dim: int, group: Group) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return C.all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return C.all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, src: int, group: Group) -> Tensor:
        ctx.src, ctx.group = src, group
        return C.broadcast(x, src, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        total = C.all_reduce(grad, ctx.group)
        if C.group_rank(ctx.group) != ctx.src:
            total.zero_()
        return total, None, None


def copy_to_region(x: Tensor, group: Group = None, *, grad_inplace: bool = False) -> Tensor:
    """Megatron's f: identity forward; backward all-reduces the gradient (moves 2x it).

    ``grad_inplace=True`` reduces the incoming gradient in place instead of a copy of it: only
    for a caller whose output feeds ops that each make a new input gradient (linear layers,
    matmuls), so the gradient arriving here (or the tensor it is a view of) is a temporary
    nothing else holds. A gradient that is not contiguous is still copied.
    """
    return apply_function(_CopyToRegion, x, group, grad_inplace)


def reduce_from_region(x: Tensor, group: Group = None, *, inplace: bool = False) -> Tensor:
    """Megatron's g: all-reduce (sum) forward, moving 2x ``x``; identity backward.

    ``inplace=True`` writes the sum into ``x`` itself and returns it (autograd's in-place
    protocol: ``x``'s history moves to this op, and a backward that saved ``x`` raises rather
    than read the sum): for a caller whose ``x`` is a temporary that nothing else reads (a
    matmul's output). A view, a non-contiguous tensor or a leaf is reduced into a copy.
    """
    return apply_function(_ReduceFromRegion, x, group, inplace)


def split_along(x: Tensor, dim: int, group: Group = None) -> Tensor:
    """Keep this rank's chunk of ``x`` along ``dim``; backward all-gathers the gradient."""
    return apply_function(_Split, x, dim, group)


def gather_along(x: Tensor, dim: int, group: Group = None) -> Tensor:
    """All-gather along ``dim`` for a replicated consumer; backward keeps this rank's chunk."""
    return apply_function(_Gather, x, dim, group, False)


def all_gather_along(x: Tensor, dim: int, group: Group = None) -> Tensor:
    """All-gather along ``dim`` for a per-rank consumer; backward reduce-scatters the gradient."""
    return apply_function(_Gather, x, dim, group, True)


def reduce_scatter_along(x: Tensor, dim: int, group: Group = None) -> Tensor:
    """Sum over ranks and keep this rank's chunk along ``dim``; backward all-gathers."""
    return apply_function(_ReduceScatter, x, dim, group)


def all_to_all_along(x: Tensor, scatter_dim: int, gather_dim: int, group: Group = None) -> Tensor:
    """Split ``x`` along ``scatter_dim`` to the ranks and concatenate what arrives along
    ``gather_dim`` (Ulysses' head/sequence swap); backward swaps the two dims back."""
    return apply_function(_AllToAll, x, scatter_dim, gather_dim, group)


def broadcast_from(x: Tensor, src: int, group: Group = None) -> Tensor:
    """Every rank gets group rank ``src``'s ``x``; backward sums the gradients into ``src``."""
    return apply_function(_Broadcast, x, src, group)
