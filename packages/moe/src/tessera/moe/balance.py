"""DeepSeek-V3's auxiliary-loss-free balancing: each router's choice bias moved after each
step by its experts' load.

A layer whose router holds a choice bias (``RouterSpec(choice_bias=True)``: ``score_bias [E]``,
added to the scores to choose experts, never to weigh them) and whose ``bias_rate`` is
``gamma > 0`` counts, in the backward of every call it trains on, the assignments each expert
was routed in that call (before capacity drops). After the optimizer step,
`balance_choice_biases` sums each layer's counts over ``group``, moves ``score_bias[e]`` by
``gamma * sign(mean - load[e])`` (down for an expert routed more than the mean of the
experts, up for one routed less, unchanged at the mean) and clears the counts.

**Why in the backward.** A call is counted once whatever runs it again: activation recompute
(torch's non-reentrant checkpoint) runs a layer's forward a second time inside the backward,
but only the first call's graph is backpropagated; an evaluation (no gradient) counts
nothing. A call that reaches no backward (nothing before or in it trains) is not counted.

**Which group.** The ranks that route different tokens of the same layer: the data-parallel
ranks (expert-parallel ranks are data-parallel ranks, each routing its own). Tensor-parallel
ranks route the same tokens (whole on every rank, or gathered whole by the layer), so the
counts are already the same there and must not be summed. Every rank then computes the same
update from the same sums: the biases stay equal without being broadcast. A serial loop over
the same chunks, calling `balance_choice_biases` after its step, moves them the same way.
"""

from __future__ import annotations

from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

from tessera.comm import all_reduce

__all__ = ["Balanced", "LoadCounter", "balance_choice_biases", "count_load", "set_bias_rate"]


class LoadCounter(Protocol):
    """What `count_load` adds a call's counts to (an `MoE` layer)."""

    pending_load: Tensor | None


class _Count(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, out: Tensor, routed: Tensor, holder: LoadCounter) -> Tensor:
        ctx.holder, ctx.routed = holder, routed  # type: ignore[attr-defined]  # FunctionCtx takes attributes
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        routed = ctx.routed.to(torch.float64)
        holder = ctx.holder
        holder.pending_load = routed if holder.pending_load is None else holder.pending_load + routed
        return grad, None, None


def count_load(out: Tensor, routed: Tensor, holder: LoadCounter) -> Tensor:
    """``out`` unchanged, whose backward adds ``routed [E]`` (a call's assignments per expert)
    to ``holder.pending_load``. Moves nothing."""
    return cast(Tensor, _Count.apply(out, routed.detach(), holder))  # type: ignore[no-untyped-call]  # torch: Function.apply is unannotated


@runtime_checkable
class Balanced(Protocol):
    """What `balance_choice_biases` moves (an `MoE` layer): its rate, its step's counts, its
    expert count and its router (whose ``score_bias`` is the choice bias, or None)."""

    bias_rate: float
    pending_load: Tensor | None
    num_experts: int
    router: Any


def _layers(module: nn.Module) -> list[Balanced]:
    return [m for m in module.modules() if isinstance(m, Balanced)]


def _balanced(module: nn.Module) -> list[Balanced]:
    return [m for m in _layers(module) if m.bias_rate > 0]


def set_bias_rate(module: nn.Module, rate: float) -> int:
    """Set ``bias_rate`` (the step ``gamma`` of auxiliary-loss-free balancing; 0: off) of every
    `MoE` layer in ``module`` whose router holds a choice bias; refuses (ValueError naming the
    values) a rate < 0 or a module without such a layer. Returns how many layers."""
    if not rate >= 0:
        raise ValueError(f"bias_rate must be >= 0, got {rate}")
    layers = [m for m in _layers(module) if getattr(m.router, "score_bias", None) is not None]
    if not layers:
        raise ValueError(
            f"{type(module).__name__} has no MoE layer whose router holds a choice bias "
            "(RouterSpec(choice_bias=True)): nothing to balance"
        )
    for m in layers:
        m.bias_rate = float(rate)
    return len(layers)


@torch.no_grad()
def balance_choice_biases(
    module: nn.Module, group: dist.ProcessGroup | None = None, *, step: bool = True
) -> int:
    """After an optimizer step: move the ``score_bias`` of every layer of ``module`` that has a
    ``bias_rate`` by its counts summed over ``group`` (module docstring; a collective over it
    when there is such a layer; None: this process's counts alone, a serial loop) and clear the
    counts. ``step=False`` (a skipped step): clear the counts, move nothing. Returns how many
    layers moved their bias."""
    layers = _balanced(module)
    if not layers:
        return 0
    device = layers[0].router.score_bias.device  # where the collective runs, with the biases
    flat = torch.cat(
        [
            (torch.zeros(m.num_experts) if m.pending_load is None else m.pending_load).to(
                device, torch.float64
            )
            for m in layers
        ]
    )
    for m in layers:
        m.pending_load = None
    if not step:
        return 0
    if group is not None:
        flat = all_reduce(flat, group)
    start = 0
    for m in layers:
        load = flat[start : start + m.num_experts]
        start += m.num_experts
        bias = m.router.score_bias
        bias += (m.bias_rate * torch.sign(load.mean() - load)).to(bias.device, bias.dtype)
    return len(layers)
