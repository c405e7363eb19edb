"""Which (token, choice) assignments reach which expert: capacity and deterministic dropping.

Pure tensor arithmetic over integer indices, no parameters and no communication. A layer
routes ``T`` tokens to ``k`` experts each; the ``T * k`` assignments are numbered in token
order (assignment ``t * k + j`` is token ``t``'s ``j``-th choice). An expert of capacity
``C`` keeps the first ``C`` assignments that chose it, in that order, and drops the rest;
without a capacity (drop-less) it keeps them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DispatchPlan", "capacity", "plan_dispatch"]


def capacity(tokens: int, experts: int, top_k: int, factor: float | None) -> int | None:
    """Assignments each expert keeps: ``ceil(factor * tokens * top_k / experts)``, or None
    (no limit) when ``factor`` is None. ``tokens`` are the tokens of one call on one rank."""
    if factor is None:
        return None
    if not factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for drop-less), got {factor}")
    return math.ceil(factor * tokens * top_k / experts)


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """The kept assignments sorted by expert (stable: token order within an expert).

    ``assignment``: index into the flattened ``[T, k]`` choices; ``token``: its token
    (``assignment // k``); ``expert``: its expert; ``kept``: kept assignments per expert
    (``[experts]``, summing to the length of the three); ``routed``: assignments that chose
    each expert before dropping.
    """

    assignment: Tensor
    token: Tensor
    expert: Tensor
    kept: Tensor
    routed: Tensor

    @property
    def dropped(self) -> int:
        """How many assignments were dropped for capacity."""
        return int(self.routed.sum()) - int(self.kept.sum())


def plan_dispatch(choices: Tensor, experts: int, cap: int | None) -> DispatchPlan:
    """Sort the assignments of ``choices`` (``[T, k]`` expert indices) by expert, keeping
    the first ``cap`` of each expert in token order (all of them when ``cap`` is None)."""
    if choices.dim() != 2:
        raise ValueError(f"choices must be [tokens, top_k], got shape {tuple(choices.shape)}")
    k = choices.shape[1]
    flat = choices.reshape(-1).long()
    routed = torch.bincount(flat, minlength=experts)
    if routed.numel() > experts:
        raise ValueError(f"choices name expert {int(flat.max())}, but there are only {experts}")
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    if cap is not None:
        starts = torch.cumsum(routed, 0) - routed
        position = torch.arange(flat.numel(), device=flat.device) - starts[by_expert]
        keep = position < cap
        order, by_expert = order[keep], by_expert[keep]
        kept = routed.clamp(max=cap)
    else:
        kept = routed
    return DispatchPlan(assignment=order, token=order // k, expert=by_expert, kept=kept, routed=routed)
