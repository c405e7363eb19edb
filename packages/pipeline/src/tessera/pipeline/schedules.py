"""Schedule generators (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV) and their registry.

Every generator returns a `Schedule` whose p2p actions follow one rule (see `_build`): a
receive sits right before the compute that consumes it and a send right after the compute
that produces it. Sends are meant to be non-blocking (``isend``) and receives blocking; under
that model, which `validate` simulates, every generated schedule is deadlock-free.

Validity rules (anything else raises ``ValueError`` naming the numbers):

- all schedules: ``p >= 1`` ranks and ``m >= 1`` microbatches; any ``m`` works, fewer
  microbatches than ranks just leaves a larger bubble.
- ``interleaved-1f1b``: ``v >= 1`` chunks per rank; for ``v > 1`` the Megatron rule
  ``m % p == 0`` (microbatches go through the chunks in groups of ``p``); ``v == 1`` is plain
  1F1B with no divisibility requirement.
- ``zbv``: always 2 chunks per rank in the V layout.
- ``gpipe``, ``1f1b``, ``zb-h1``: one stage per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tessera.pipeline._build import check_counts, with_p2p
from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.partition import Layout, stage_to_rank
from tessera.pipeline.zero_bubble import zbv, zero_bubble_h1

__all__ = [
    "SCHEDULES",
    "SCHEDULE_LAYOUTS",
    "ScheduleFn",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule_stage_to_rank",
    "zbv",
    "zero_bubble_h1",
]

_F, _BW = ActionKind.F, ActionKind.BW


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` full backwards (BW).

    Peak in-flight activations: ``m`` on every rank.
    """
    check_counts("gpipe", p, m)
    compute = [
        [Action(_F, i, r) for i in range(m)] + [Action(_BW, i, r) for i in range(m)]
        for r in range(p)
    ]
    return with_p2p("gpipe", m, range(p), compute)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): ``min(p - r - 1, m)`` warm-up forwards on rank ``r``, then
    alternate one forward and one full backward (BW), then drain the backwards.

    Peak in-flight activations on rank ``r``: ``min(p - r, m)``.
    """
    check_counts("1f1b", p, m)
    return with_p2p("1f1b", m, range(p), [_one_f_one_b_order(p, m, r) for r in range(p)])


def _one_f_one_b_order(p: int, m: int, r: int) -> list[Action]:
    warmup = min(p - r - 1, m)
    order = [Action(_F, i, r) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(_F, warmup + i, r), Action(_BW, i, r)]
    order += [Action(_BW, i, r) for i in range(m - warmup, m)]
    return order


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron virtual pipeline): ``v`` chunks per rank, stage ``c*p + r``
    on rank ``r``; full backwards (BW).

    Microbatches move through the chunks in groups of ``p``: the k-th forward of a rank is
    chunk ``(k // p) % v`` of microbatch ``(k // (p*v)) * p + k % p``; backwards visit the
    chunks in reverse. Rank ``r`` warms up with ``2*(p - r - 1) + (v - 1)*p`` forwards (capped
    at ``m*v``), then alternates forward/backward. Requires ``m % p == 0`` when ``v > 1``.
    """
    check_counts("interleaved-1f1b", p, m)
    if v < 1:
        raise ValueError(f"interleaved-1f1b needs v >= 1 chunks per rank; got v={v}")
    if v == 1:
        return with_p2p(
            "interleaved-1f1b", m, range(p), [_one_f_one_b_order(p, m, r) for r in range(p)]
        )
    if m % p:
        raise ValueError(
            f"interleaved-1f1b with v={v} needs the microbatch count to be a multiple of the "
            f"pipeline ranks (Megatron rule); got m={m}, p={p}"
        )
    total = m * v

    def unit(k: int, forward: bool, r: int) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return (k // (p * v)) * p + k % p, chunk * p + r

    compute: list[list[Action]] = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [Action(_F, *unit(k, True, r)) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(Action(_F, *unit(warmup + k, True, r)))
            order.append(Action(_BW, *unit(k, False, r)))
        order += [Action(_BW, *unit(k, False, r)) for k in range(total - warmup, total)]
        compute.append(order)
    return with_p2p("interleaved-1f1b", m, stage_to_rank(Layout.LOOP, p, v), compute)


class ScheduleFn(Protocol):
    """A registry entry: build a schedule for ``p`` ranks, ``m`` microbatches, ``v`` chunks."""

    def __call__(self, p: int, m: int, v: int | None = None) -> Schedule: ...


def _fixed(name: str, chunks: int, fn: Callable[[int, int], Schedule]) -> ScheduleFn:
    def build(p: int, m: int, v: int | None = None) -> Schedule:
        if v is not None and v != chunks:
            raise ValueError(f"{name} always places {chunks} chunk(s) per rank; got v={v}")
        return fn(p, m)

    return build


def _interleaved(p: int, m: int, v: int | None = None) -> Schedule:
    return interleaved_1f1b(p, m, 2 if v is None else v)


SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": _fixed("gpipe", 1, gpipe),
    "1f1b": _fixed("1f1b", 1, one_f_one_b),
    "interleaved-1f1b": _interleaved,
    "zb-h1": _fixed("zb-h1", 1, zero_bubble_h1),
    "zbv": _fixed("zbv", 2, zbv),
}
"""Schedule generators by name; each takes ``(p, m, v=None)``."""

SCHEDULE_LAYOUTS: dict[str, Layout] = {
    "gpipe": Layout.LOOP,
    "1f1b": Layout.LOOP,
    "interleaved-1f1b": Layout.LOOP,
    "zb-h1": Layout.LOOP,
    "zbv": Layout.V,
}
"""How each named schedule places virtual stages on ranks."""


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """Build the named schedule (see `SCHEDULES`).

    ``v`` is the number of chunks per rank: free for ``interleaved-1f1b`` (default 2), fixed
    for the others (2 for ``zbv``, 1 otherwise); ``None`` takes the schedule's own.
    """
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known: {sorted(SCHEDULES)}") from None
    return fn(p, m, v)


def schedule_stage_to_rank(name: str, p: int, v: int | None = None) -> tuple[int, ...]:
    """The rank of every virtual stage for the named schedule with ``p`` ranks."""
    if name not in SCHEDULE_LAYOUTS:
        raise ValueError(f"unknown schedule {name!r}; known: {sorted(SCHEDULE_LAYOUTS)}")
    chunks = {"interleaved-1f1b": 2 if v is None else v, "zbv": 2}.get(name, 1)
    if v is not None and v != chunks:
        raise ValueError(f"{name} always places {chunks} chunk(s) per rank; got v={v}")
    return stage_to_rank(SCHEDULE_LAYOUTS[name], p, chunks)
