"""Lowering of per-rank compute orders to a `Schedule` with p2p actions."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.pipeline.actions import Action, ActionKind, Schedule

__all__ = ["with_p2p"]

_BACKWARDS = (ActionKind.B, ActionKind.BW)


def with_p2p(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    compute: Sequence[Sequence[Action]],
) -> Schedule:
    """Build a `Schedule` from per-rank compute orders by adding the p2p actions.

    Each receive is placed right before the compute that consumes it and each send right
    after the compute that produces it. Sends never wait, so with blocking receives this
    lowering is deadlock-free whenever the compute orders respect the data dependencies.
    """
    ranks = tuple(stage_to_rank)
    last = len(ranks) - 1
    lowered: list[tuple[Action, ...]] = []
    for rank, acts in enumerate(compute):
        out: list[Action] = []
        for a in acts:
            mb, s = a.microbatch, a.stage
            if a.kind is ActionKind.F:
                if s > 0 and ranks[s - 1] != rank:
                    out.append(Action(ActionKind.RECV_F, mb, s, ranks[s - 1]))
                out.append(a)
                if s < last and ranks[s + 1] != rank:
                    out.append(Action(ActionKind.SEND_F, mb, s, ranks[s + 1]))
            elif a.kind in _BACKWARDS:
                if s < last and ranks[s + 1] != rank:
                    out.append(Action(ActionKind.RECV_B, mb, s, ranks[s + 1]))
                out.append(a)
                if s > 0 and ranks[s - 1] != rank:
                    out.append(Action(ActionKind.SEND_B, mb, s, ranks[s - 1]))
            else:
                out.append(a)
        lowered.append(tuple(out))
    return Schedule(
        name=name,
        num_ranks=len(lowered),
        num_microbatches=num_microbatches,
        num_stages=len(ranks),
        stage_to_rank=ranks,
        actions=tuple(lowered),
    )
