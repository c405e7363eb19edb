"""Entering the tp region with its input-gradient all-reduce overlapped by weight gradients.

Entering the region (Megatron's f) does nothing forward and all-reduces the input gradient
backward. In a plain autograd graph that all-reduce starts only after every column-parallel
linear reading the region's input has computed both its input and its weight gradients, and
the rank then waits for it with nothing to do. Megatron overlaps it inside one linear layer
(start the all-reduce of the input gradient, compute the weight gradient, wait). A region
here may hold several column layers sharing its input (q, k and v; gate and up), so the
weight gradients move out of the linears into one node that runs while the all-reduce is
in flight. One forward call of a region builds::

    x -> _Wait -> _WeightGrads(weights, biases) -> _Start -> column linears

(with sequence parallelism ``_Wait`` also all-gathers the sequence forward, and the
all-reduce below is the reduce-scatter of the gradient)

and backward then runs, in the order the dependencies force:

1. each linear (``_DeferredLinear``) computes its input gradient only, keeping its input
   and output gradient for later;
2. ``_Start`` starts the all-reduce of the summed input gradient (asynchronously);
3. ``_WeightGrads`` computes every weight and bias gradient from what the linears kept
   (``grad_out^T @ input`` and ``grad_out`` summed: the same products a plain backward
   computes), and autograd accumulates them into the parameters as usual (hooks fire);
4. ``_Wait`` waits for the all-reduce and hands the reduced gradient on.

Only gradients the running backward will use are computed: each parameter reaches
``_WeightGrads`` through a view (a node autograd can be asked about:
``torch._C._will_engine_execute_node``), so under zero-bubble's split backward the input
pass (``autograd.grad`` for the stage input) skips the weight gradients and the weight pass
(restarted at ``_WeightGrads``) computes them from what the linears kept. A linear keeps one
(input, output gradient) per forward call, replaced when a retained graph runs it again, so
a gradient is never counted twice.

A linear joins its region's deferral only when it reads the region's input itself (the
tensor ``Region.enter`` returned); anything else inside the region (a linear reading another
tensor, a grouped-query copy whose weight gradient is summed over ranks) keeps the plain path.

Leaving the region (a row layer's all-reduce of its partial product) is on forward's critical
path: ``summed_linear`` splits the product into pieces of rows, each piece's all-reduce
running while the next piece is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import Node

from tessera.comm import Group, Handle, all_gather, all_reduce_async, reduce_scatter_async
from tessera.comm.ops import apply_function

__all__ = ["Region", "Slot", "overlaps", "summed_linear"]


def overlaps(x: Tensor) -> bool:
    """Whether entering the region with ``x`` builds the overlapped graph: only when a
    backward will run through it (grad mode on and ``x`` carrying a gradient)."""
    return torch.is_grad_enabled() and x.requires_grad


@dataclass(eq=False)
class Slot:
    """One column linear's deferred weight gradient within one region call: its parameters
    and, filled by its backward, the (input, output gradient) of each call."""

    region: Region
    weight: Tensor
    bias: Tensor | None
    calls: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # per linear node

    def linear(self, x: Tensor) -> Tensor:
        """``F.linear(x, weight, bias)`` whose weight and bias gradients the region computes."""
        bias = None if self.bias is None else self.bias.detach()
        self.region.readers += 1
        return apply_function(_DeferredLinear, x, self.weight.detach(), bias, self)

    def grads(self) -> tuple[Tensor | None, Tensor | None]:
        """The weight and bias gradients of the kept calls (None for a linear never reached)."""
        if not self.calls:
            return None, None
        gw: Tensor | None = None
        gb: Tensor | None = None
        for x, g in self.calls.values():
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            w = g2.t().mm(x2)
            gw = w if gw is None else gw.add_(w)
            if self.bias is not None:
                b = g2.sum(0)
                gb = b if gb is None else gb.add_(b)
        self.calls.clear()
        return gw, gb


class Region:
    """One entry into the tp region (one forward call): add the column layers' ``slot``\\ s,
    then ``enter`` the input. With ``sequence_parallel`` the input is this rank's slice along
    ``seq_dim``: entering all-gathers it, and backward reduce-scatters the gradient
    (asynchronously, overlapped the same way) instead of all-reducing it.

    The all-reduce runs in place when a deferred linear read the input (``readers``): the
    gradient reaching ``_Start`` is then that linear's fresh input gradient, or a sum autograd
    made of several (a new tensor, or one it owned alone), so nothing else can see the
    buffer change. Otherwise (only other consumers) the gradient may be a tensor autograd
    also hands elsewhere, and a copy is reduced."""

    def __init__(self, group: Group, *, sequence_parallel: bool = False, seq_dim: int = -2) -> None:
        self.group = group
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.readers = 0  # forward calls of the slots' linears on the input
        self.slots: list[Slot] = []
        self.input: Tensor | None = None
        self.handle: Handle[Tensor] | None = None

    def slot(self, weight: Tensor, bias: Tensor | None) -> Slot:
        """Defer the weight gradients of a linear with these parameters (before ``enter``)."""
        if self.input is not None:
            raise RuntimeError("Region.slot after Region.enter: the weights must be known before entering")
        s = Slot(self, weight, bias)
        self.slots.append(s)
        return s

    def enter(self, x: Tensor) -> Tensor:
        """``x`` inside the region: the tensor the slots' linears must read."""
        waited = apply_function(_Wait, x, self)
        # the views made after _Wait run before it in backward: gradients land while in flight
        params = [
            t.view_as(t) if t.requires_grad else t
            for s in self.slots
            for t in (s.weight, s.bias)
            if t is not None
        ]
        kept = apply_function(_WeightGrads, waited, self, *params)
        self.input = apply_function(_Start, kept, self)
        return self.input

    def close(self) -> None:
        """End the forward call: forget the input. (It is the output of ``_Start``, whose
        node holds this region: kept, the two would form a cycle through autograd's C++ graph
        that Python's collector cannot see, and leak every step's graph.)"""
        self.input = None

    def gather(self, x: Tensor) -> Tensor:
        """Forward of the entry: ``x`` itself, or under SP the whole sequence."""
        if self.sequence_parallel:
            return all_gather(x, self.group, self.seq_dim)
        return x.view_as(x)

    def start(self, grad: Tensor) -> Tensor:
        if self.sequence_parallel:  # reads grad, writes a new tensor: nothing to copy
            self.handle = reduce_scatter_async(grad, self.group, self.seq_dim)
            return grad
        buffer = grad if self.readers and grad.is_contiguous() else grad.contiguous().clone()
        self.handle = all_reduce_async(buffer, self.group, inplace=True)
        return buffer

    def finish(self, grad: Tensor) -> Tensor:
        handle, self.handle = self.handle, None
        return grad if handle is None else handle.wait()


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, slot: Slot) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.slot.calls[id(ctx)] = (x.detach(), grad)  # detached: no path back to this graph
        return grad.matmul(weight), None, None, None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, region: Region) -> Tensor:
        ctx.region = region
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.region.start(grad), None


class _WeightGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, region: Region, *params: Tensor) -> Tensor:
        ctx.region = region
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        edges = iter(ctx.next_functions[1:])  # one per tensor input: x, then params
        out: list[Tensor | None] = []
        for slot in ctx.region.slots:
            wanted = [_will_run(next(edges)[0])]
            if slot.bias is not None:
                wanted.append(_will_run(next(edges)[0]))
            if any(wanted):
                gw, gb = slot.grads()
                out += [gw, gb][: len(wanted)]
            else:
                out += [None] * len(wanted)
        return (grad, None, *out)


def _will_run(node: Node | None) -> bool:
    return node is not None and bool(torch._C._will_engine_execute_node(node))


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, region: Region) -> Tensor:
        ctx.region = region
        return region.gather(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.region.finish(grad), None


class _StartSum(torch.autograd.Function):
    """Identity for autograd; forward starts summing ``y`` over the group in place (a row
    layer's partial product: a temporary nothing else reads) and files the handle."""

    @staticmethod
    def forward(ctx: FunctionCtx, y: Tensor, group: Group, handles: list[Handle[Tensor]]) -> Tensor:
        handles.append(all_reduce_async(y, group, inplace=True))
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


def summed_linear(x: Tensor, weight: Tensor, group: Group, chunks: int) -> Tensor:
    """``F.linear(x, weight)`` summed over ``group`` (a row layer's exit without sequence
    parallelism), computed in ``chunks`` pieces of ``x``'s rows: each piece's all-reduce runs
    while the next piece is computed. Backward as the plain exit: nothing moved. The weight
    gradient is the sum of the pieces' products (equal to one product to fp32 round-off)."""
    rows = x.reshape(-1, x.shape[-1])
    handles: list[Handle[Tensor]] = []
    pieces = [
        apply_function(_StartSum, F.linear(piece, weight), group, handles) for piece in rows.chunk(chunks)
    ]
    for handle in handles:
        handle.wait()
    return torch.cat(pieces).view(*x.shape[:-1], weight.shape[0])
