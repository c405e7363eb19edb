"""Splitting a serial `tessera.moe.MoE` layer in place: its experts over an expert-parallel
group (`shard_experts`), or every expert's hidden units over a tensor-parallel group
(`split_hidden`; `tessera.moe.layer`'s docstring says what the layer then computes). Each
takes any layer holding what it changes (`Splittable`, which `tessera.moe.MoE` is), so that
this module need not import the layer's."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch.distributed as dist
from torch import nn

from tessera.comm import Group, group_rank, group_size
from tessera.moe.experts import Experts
from tessera.moe.norms import norm_split_problem

__all__ = ["Gather", "Splittable", "ep_split", "hidden_split_problem", "shard_experts", "split_hidden"]

_log = logging.getLogger(__name__)

Gather = tuple[int, Group]
"""An all-gather that enters the layer's tp region: (the dim of the activations, the group
whose ranks hold its blocks, in group-rank order)."""


class Splittable(Protocol):
    """What the splits read and change of a mixture-of-experts layer (`tessera.moe.MoE`)."""

    num_experts: int
    first_expert: int
    experts: Experts
    shared: Experts | None
    post_norm: nn.Parameter | None
    ep_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    gathers: tuple[Gather, ...]


Layer = TypeVar("Layer", bound=Splittable)


def ep_split(experts: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """This rank's experts ``start, stop`` in ``group``; refuses an uneven split."""
    ep = group_size(group)
    if experts % ep:
        raise ValueError(f"experts ({experts}) must be divisible by the ep group's size ({ep})")
    local = experts // ep
    start = group_rank(group) * local
    return start, start + local


def shard_experts(layer: Layer, group: dist.ProcessGroup) -> Layer:
    """Make a serial ``layer`` expert-parallel over ``group`` in place: keep this rank's
    ``experts / ep`` experts (copies of the serial layer's) and exchange tokens over the group.
    Every rank must hold the same serial layer. Returns the layer."""
    if layer.ep_group is not None:
        raise ValueError("the layer is already expert-parallel")
    start, stop = ep_split(layer.num_experts, group)
    layer.experts.keep(start, stop)
    layer.first_expert, layer.ep_group = start, group
    _log.debug("experts %d..%d of %d on this rank", start, stop - 1, layer.num_experts)
    return layer


def hidden_split_problem(layer: Splittable, tp: int) -> str:
    """Why ``split_hidden`` cannot split ``layer`` over ``tp`` ranks ("" when it can): a bank
    that normalises its experts' outputs (at any tp, `tessera.moe.norms`), or a hidden width of
    the experts or the shared expert that ``tp`` does not divide."""
    banks = [("experts", layer.experts)] + ([("shared", layer.shared)] if layer.shared is not None else [])
    normed = norm_split_problem({name: bank.norm is not None for name, bank in banks})
    if normed:
        return normed
    uneven = [f"{name} hidden {bank.hidden}" for name, bank in banks if bank.hidden % tp]
    return f"tp={tp} must divide the hidden width of every expert: {', '.join(uneven)}" if uneven else ""


def split_hidden(
    layer: Layer,
    group: dist.ProcessGroup,
    *,
    sequence_parallel: bool = False,
    seq_dim: int = -2,
    gathers: Sequence[Gather] = (),
) -> Layer:
    """Make ``layer`` tensor-parallel inside its experts over ``group`` in place (module
    docstring): keep this rank's ``hidden / tp`` hidden units of every expert and of the
    shared expert. Every rank of ``group`` must see the same whole tokens inside the layer:
    its input is whole on every rank (the default), or ``sequence_parallel`` (the input and
    output hold this rank's slice of dim ``seq_dim``, gathered over ``group``), or
    ``gathers`` (all-gathers along dims over groups, in order, whose ranks multiply to
    ``group``'s: a 2D grid's hidden over its row, then its batch over its column). Every rank
    must hold the same serial layer; refuses (ValueError naming the widths, nothing changed) a
    hidden width ``tp`` does not divide. Returns the layer."""
    if layer.tp_group is not None:
        raise ValueError("the layer's experts are already split over a tp group")
    if sequence_parallel and gathers:
        raise ValueError("give sequence_parallel or gathers, not both (sequence parallelism is one gather)")
    tp, rank = group_size(group), group_rank(group)
    problem = hidden_split_problem(layer, tp)
    if problem:
        raise ValueError(problem)
    if layer.post_norm is not None and len(gathers) > 1:
        raise ValueError(
            f"a post-norm needs each token's whole hidden after the layer, but {len(gathers)} gathers "
            "(2D, 2.5D or 3D tensor parallelism) leave each rank a block of it"
        )
    spans = math.prod(group_size(g) for _, g in gathers)
    if gathers and spans != tp:
        raise ValueError(f"the gathers span {spans} ranks, but the tp group has {tp}")
    for bank in (layer.experts, layer.shared):
        if bank is None:
            continue
        share = bank.hidden // tp
        bank.keep_hidden(rank * share, (rank + 1) * share)
    layer.tp_group = group
    layer.gathers = ((seq_dim, group),) if sequence_parallel else tuple(gathers)
    _log.debug("expert hidden units split over tp=%d (rank %d)", tp, rank)
    return layer
