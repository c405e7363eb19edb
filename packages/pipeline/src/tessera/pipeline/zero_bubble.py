"""Zero-bubble schedules: the backward is split into B (input grad) and W (weight grad).

Only B lies on the critical path between stages; W can run whenever its rank would idle.

- `zero_bubble_h1` (ZB-H1): 1F1B's forward/backward order, with each rank's W passes
  lagging its B passes by ``r`` microbatches on rank ``r``. The deferred W's fill the
  cool-down that 1F1B leaves idle. With unit costs F = B = W and ``m >= p`` the makespan is
  ``3m + p - 1``: every rank idles ``p - 1``, a third of 1F1B's ``3(p - 1)`` (BW = B + W).
  Rank ``r`` has at most ``min(p - r, m)`` microbatches between F and B, as in 1F1B, and at
  most ``min(p, m)`` between F and W (1F1B's peak).
- `zbv` (ZB-V): two chunks per rank in the V layout (rank ``r`` holds stages ``r`` and
  ``2p - 1 - r``). Its order comes from list scheduling under unit costs F = B = W: whenever a
  rank is free it runs the first ready B (its first chunk first), else the first ready F (its
  second chunk first) if it holds fewer than ``2p`` chunk activations, else its oldest pending
  W. ``2p`` chunk activations are 1F1B's peak on rank 0 for the same model. This is a
  heuristic, not a proven optimum: with unit costs and ``2p <= m`` the makespan is within 2
  of the lower bound ``6m + p - 1`` (rank ``p - 1`` cannot start before ``p - 1``), which
  the tests check for ``p <= 8, m <= 32``; it is exactly the bound for most (p, m).
"""

from __future__ import annotations

import math
from collections import deque

from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.layout import Layout
from tessera.pipeline.spec import ScheduleSpec

__all__ = ["ZBV", "ZB_H1", "zbv", "zero_bubble_h1"]

_F, _B, _W = ActionKind.F, ActionKind.B, ActionKind.W


def _zb_h1_order(p: int, m: int, ranks: tuple[int, ...]) -> list[list[Action]]:
    compute: list[list[Action]] = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action(_F, i, r) for i in range(warmup)]
        next_w = 0
        for j in range(m):
            if j < m - warmup:
                order.append(Action(_F, warmup + j, r))
            order.append(Action(_B, j, r))
            if j >= r:
                order.append(Action(_W, next_w, r))
                next_w += 1
        order += [Action(_W, i, r) for i in range(next_w, m)]
        compute.append(order)
    return compute


def _zbv_order(p: int, m: int, ranks: tuple[int, ...]) -> list[list[Action]]:
    return _list_schedule(p, m, ranks, cap=2 * p)


ZB_H1 = ScheduleSpec("zb-h1", _zb_h1_order)
"""ZB-H1: one stage per rank in the loop layout, split backward."""

ZBV = ScheduleSpec("zbv", _zbv_order, layout=Layout.V, default_chunks=2)
"""ZB-V: always two chunks per rank in the V layout, split backward."""


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B order with split backward; rank ``r``'s W's trail its B's by ``r``."""
    return ZB_H1.build(p, m)


def zbv(p: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V, split backward, ordered by unit-cost list scheduling."""
    return ZBV.build(p, m)


def _list_schedule(p: int, m: int, ranks: tuple[int, ...], cap: int) -> list[list[Action]]:
    """Per-rank compute orders from a greedy unit-time simulation (see the module doc).

    ``cap`` bounds, per rank, both the chunk activations between F and B and those between
    F and W. Every stage runs its F's, B's and W's in microbatch order.
    """
    last = len(ranks) - 1
    stages = [[s for s, owner in enumerate(ranks) if owner == r] for r in range(p)]
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    next_f = [0] * len(ranks)
    next_b = [0] * len(ranks)
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    in_flight = [0] * p  # F done, B not yet
    held = [0] * p  # F done, W not yet
    free_at = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    left = 3 * m * len(ranks)
    t = 0
    while left:
        for r in range(p):
            if free_at[r] > t:
                continue
            may_forward = in_flight[r] < cap and held[r] < cap
            act = _pick(t, m, last, stages[r], f_end, b_end, next_f, next_b, pending_w[r],
                        may_forward)
            if act is None:
                continue
            key = (act.microbatch, act.stage)
            if act.kind is _F:
                f_end[key] = t + 1
                next_f[act.stage] += 1
                in_flight[r] += 1
                held[r] += 1
            elif act.kind is _B:
                b_end[key] = t + 1
                next_b[act.stage] += 1
                in_flight[r] -= 1
                pending_w[r].append(key)
            else:
                held[r] -= 1
            orders[r].append(act)
            free_at[r] = t + 1
            left -= 1
        t += 1
        if t > 8 * m * len(ranks) + 4 * p:  # pragma: no cover - a bug, not an input error
            raise RuntimeError(f"list scheduling stalled at t={t} (p={p}, m={m})")
    return orders


def _pick(
    t: int,
    m: int,
    last: int,
    stages: list[int],
    f_end: dict[tuple[int, int], int],
    b_end: dict[tuple[int, int], int],
    next_f: list[int],
    next_b: list[int],
    pending_w: deque[tuple[int, int]],
    may_forward: bool,
) -> Action | None:
    """What a rank holding ``stages`` starts at time ``t``: a ready B, else F, else W, else None."""
    for s in stages:
        i = next_b[s]
        if (
            i < m
            and f_end.get((i, s), math.inf) <= t
            and (s == last or b_end.get((i, s + 1), math.inf) <= t)
        ):
            return Action(_B, i, s)
    if may_forward:
        for s in reversed(stages):
            i = next_f[s]
            if i < m and (s == 0 or f_end.get((i, s - 1), math.inf) <= t):
                return Action(_F, i, s)
    if pending_w:
        i, s = pending_w.popleft()
        return Action(_W, i, s)
    return None
