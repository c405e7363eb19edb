"""Completing gradients under expert parallelism combined with data parallelism.

``W`` data-parallel ranks each hold their own tokens; they form ``edp = W / ep`` ep groups,
and the ranks holding the same experts (the same place in their ep groups) form an
expert-data-parallel group. The training loss is the mean of the ranks' losses. A dense
parameter (router, shared expert, anything outside the experts) is replicated on all ``W``
ranks: its gradient is averaged over the data group. An expert's gradient on its owner
already sums its ep group's tokens (the backward all-to-all brought them), so summing it
over the expert-data-parallel group covers all ``W`` ranks, and dividing by ``W`` gives the
same mean.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from tessera.comm import all_reduce, group_size
from tessera.moe.layer import MoE

__all__ = ["expert_parameters", "reduce_gradients"]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of every `MoE` layer's experts in ``module`` (not routers, not shared
    experts): those that live on their ep rank only."""
    return [p for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def reduce_gradients(
    module: nn.Module, *, data_group: dist.ProcessGroup | None, expert_data_group: dist.ProcessGroup | None
) -> None:
    """After backward, make every gradient of ``module`` that of the mean loss over the data
    group: dense ones averaged over ``data_group`` (all ranks with their own tokens), expert
    ones summed over ``expert_data_group`` and divided by the data group's size. In place;
    one all-reduce per parameter with a gradient (moves 2x it). ``None`` is the world."""
    world = group_size(data_group)
    experts = {id(p) for p in expert_parameters(module)}
    for p in module.parameters():
        if p.grad is None:
            continue
        if id(p) in experts:
            all_reduce(p.grad, expert_data_group, inplace=True).div_(world)
        else:
            all_reduce(p.grad, data_group, "avg", inplace=True)
