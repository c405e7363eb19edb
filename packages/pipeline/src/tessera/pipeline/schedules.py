"""The one-backward schedules (GPipe, 1F1B, interleaved 1F1B): generators and their specs.

Each schedule is a `ScheduleSpec` (``GPIPE``, ``ONE_F_ONE_B``, ``INTERLEAVED_1F1B``) holding
its generator, layout, chunks per rank and rules; the functions ``gpipe(p, m)`` etc. are
``spec.build``. Validity (anything else raises ``ValueError`` naming the numbers; the spec's
``check`` lists every broken rule without building):

- all schedules: ``p >= 1`` ranks and ``m >= 1`` microbatches; any ``m`` works, fewer
  microbatches than ranks just leaves a larger bubble.
- ``gpipe``, ``1f1b``: one stage per rank, `Layout.LOOP`.
- ``interleaved-1f1b``: ``v >= 1`` chunks per rank (default 2), `Layout.LOOP`; for ``v > 1``
  the Megatron rule ``m % p == 0`` (microbatches go through the chunks in groups of ``p``);
  ``v == 1`` is plain 1F1B with no divisibility requirement.
"""

from __future__ import annotations

from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.layout import Layout
from tessera.pipeline.spec import ScheduleSpec

__all__ = [
    "GPIPE",
    "INTERLEAVED_1F1B",
    "ONE_F_ONE_B",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
]

_F, _BW = ActionKind.F, ActionKind.BW


def _gpipe_order(p: int, m: int, ranks: tuple[int, ...]) -> list[list[Action]]:
    return [
        [Action(_F, i, r) for i in range(m)] + [Action(_BW, i, r) for i in range(m)]
        for r in range(p)
    ]


def _one_f_one_b_order(p: int, m: int, ranks: tuple[int, ...]) -> list[list[Action]]:
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action(_F, i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(_F, warmup + i, r), Action(_BW, i, r)]
        order += [Action(_BW, i, r) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _interleaved_order(p: int, m: int, ranks: tuple[int, ...]) -> list[list[Action]]:
    v = len(ranks) // p
    if v == 1:
        return _one_f_one_b_order(p, m, ranks)
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
    return compute


def _megatron_rule(p: int, m: int, v: int) -> str | None:
    if v > 1 and m % p:
        return (
            f"interleaved-1f1b with v={v} needs the microbatch count to be a multiple of the "
            f"pipeline ranks (Megatron rule); got m={m}, p={p}"
        )
    return None


GPIPE = ScheduleSpec("gpipe", _gpipe_order)
"""GPipe: every rank runs all ``m`` forwards, then all ``m`` full backwards (BW)."""

ONE_F_ONE_B = ScheduleSpec("1f1b", _one_f_one_b_order)
"""1F1B (PipeDream-flush): warm-up forwards, then one forward / one full backward."""

INTERLEAVED_1F1B = ScheduleSpec(
    "interleaved-1f1b",
    _interleaved_order,
    layout=Layout.LOOP,  # the order puts chunk c of rank r at stage c * p + r
    default_chunks=2,
    min_chunks=1,
    rules=(_megatron_rule,),
)
"""Interleaved 1F1B (Megatron virtual pipeline), ``v`` chunks per rank in the loop layout."""


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` full backwards (BW).

    Peak in-flight activations: ``m`` on every rank.
    """
    return GPIPE.build(p, m)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): ``min(p - r - 1, m)`` warm-up forwards on rank ``r``, then
    alternate one forward and one full backward (BW), then drain the backwards.

    Peak in-flight activations on rank ``r``: ``min(p - r, m)``.
    """
    return ONE_F_ONE_B.build(p, m)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron virtual pipeline): ``v`` chunks per rank, stage ``c*p + r``
    on rank ``r``; full backwards (BW).

    Microbatches move through the chunks in groups of ``p``: the k-th forward of a rank is
    chunk ``(k // p) % v`` of microbatch ``(k // (p*v)) * p + k % p``; backwards visit the
    chunks in reverse. Rank ``r`` warms up with ``2*(p - r - 1) + (v - 1)*p`` forwards (capped
    at ``m*v``), then alternates forward/backward. Requires ``m % p == 0`` when ``v > 1``.
    """
    return INTERLEAVED_1F1B.build(p, m, v)
