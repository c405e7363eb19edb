"""One validator for every schedule: completeness, dependencies, p2p pairing, no deadlock.

`validate` raises ``ValueError`` with the first problem it finds, in this order:

1. placement: every action names a microbatch and stage in range, on the rank that holds the
   stage; p2p actions cross ranks and name the rank of the neighbouring stage as peer;
2. completeness: every (microbatch, stage) has exactly one F and either exactly one BW or
   exactly one B and one W;
3. pairing: every cross-rank edge carries exactly one send and one matching receive, in both
   directions; edges inside a rank carry none;
4. local order: on each rank, F(mb, s) comes after F(mb, s-1) (same rank) or after its
   RECV_F; a backward (B or BW) comes after its own F and after the backward of s+1 (same
   rank) or its RECV_B; W after B; each send after the compute that produces its tensor;
5. progress: executing all ranks under the p2p model never gets stuck.

The p2p model of step 5 is `P2PModel.BUFFERED_SENDS` by default: a send never blocks (an
``isend`` whose completion is awaited only at the end of the step), a receive blocks until
the matching send has been issued. This is what the runtime does, and every generated
schedule passes it. `P2PModel.RENDEZVOUS` (a send completes only together with its receive)
is stricter; GPipe passes it, 1F1B-style schedules do not.
"""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum

from tessera.pipeline.actions import Action, ActionKind, Schedule

__all__ = ["P2PModel", "validate"]

K = ActionKind
_SENDS = (K.SEND_F, K.SEND_B)
_RECVS = (K.RECV_F, K.RECV_B)
_Key = tuple[ActionKind, int, int]  # (kind, microbatch, stage)


class P2PModel(StrEnum):
    """The blocking semantics under which `validate` proves progress."""

    BUFFERED_SENDS = "buffered-sends"
    """Sends never block; a receive blocks until its send was issued."""
    RENDEZVOUS = "rendezvous"
    """A send and its receive block until both are posted, then complete together."""


def validate(schedule: Schedule, *, model: P2PModel = P2PModel.BUFFERED_SENDS) -> None:
    """Raise ``ValueError`` naming the first problem if ``schedule`` cannot run correctly."""
    _check_placement(schedule)
    where = _index(schedule)
    _check_complete(schedule, where)
    _check_pairs(schedule, where)
    _check_order(schedule, where)
    stuck = _stuck_ranks(schedule, model)
    if stuck:
        raise ValueError(f"{schedule.name}: deadlock under the {model} p2p model: {stuck}")


def _peer_stage(a: Action) -> int:
    return a.stage + 1 if a.kind in (K.SEND_F, K.RECV_B) else a.stage - 1


def _check_placement(sch: Schedule) -> None:
    owner = sch.stage_to_rank
    for r, acts in enumerate(sch.actions):
        for i, a in enumerate(acts):
            at = f"{sch.name}: rank {r} action {i} ({a})"
            if a.microbatch >= sch.num_microbatches:
                raise ValueError(f"{at}: microbatch outside 0..{sch.num_microbatches - 1}")
            if a.stage >= sch.num_stages:
                raise ValueError(f"{at}: stage outside 0..{sch.num_stages - 1}")
            if owner[a.stage] != r:
                raise ValueError(f"{at}: stage {a.stage} lives on rank {owner[a.stage]}")
            if a.is_compute:
                continue
            other = _peer_stage(a)
            if not 0 <= other < sch.num_stages:
                raise ValueError(f"{at}: stage {a.stage} has no neighbour stage {other}")
            if owner[other] == r:
                raise ValueError(
                    f"{at}: stages {a.stage} and {other} are both on rank {r}; "
                    "they exchange tensors locally, without p2p"
                )
            if a.peer != owner[other]:
                raise ValueError(f"{at}: peer should be rank {owner[other]} (stage {other})")


def _index(sch: Schedule) -> dict[_Key, list[int]]:
    """Positions of each (kind, microbatch, stage) in its rank's list (the stage fixes the rank)."""
    where: dict[_Key, list[int]] = defaultdict(list)
    for acts in sch.actions:
        for i, a in enumerate(acts):
            where[(a.kind, a.microbatch, a.stage)].append(i)
    return where


def _check_complete(sch: Schedule, where: dict[_Key, list[int]]) -> None:
    for mb in range(sch.num_microbatches):
        for s in range(sch.num_stages):
            at = f"{sch.name}: microbatch {mb} stage {s} (rank {sch.stage_to_rank[s]})"
            n = {k: len(where.get((k, mb, s), ())) for k in (K.F, K.B, K.W, K.BW)}
            if n[K.F] != 1:
                pos = where.get((K.F, mb, s), [])
                raise ValueError(f"{at}: {n[K.F]} F actions at positions {pos}; expected one")
            if (n[K.BW], n[K.B], n[K.W]) not in ((1, 0, 0), (0, 1, 1)):
                raise ValueError(
                    f"{at}: found BW={n[K.BW]} B={n[K.B]} W={n[K.W]}; "
                    "expected exactly one BW, or exactly one B and one W"
                )


def _check_pairs(sch: Schedule, where: dict[_Key, list[int]]) -> None:
    owner = sch.stage_to_rank
    for mb in range(sch.num_microbatches):
        for s in range(sch.num_stages - 1):
            lo, hi = owner[s], owner[s + 1]
            if lo == hi:
                continue  # placement already rejected p2p on local edges
            pairs = (
                (Action(K.SEND_F, mb, s, hi), Action(K.RECV_F, mb, s + 1, lo)),
                (Action(K.SEND_B, mb, s + 1, lo), Action(K.RECV_B, mb, s, hi)),
            )
            for send, recv in pairs:
                for a, other in ((send, recv), (recv, send)):
                    count = len(where.get((a.kind, a.microbatch, a.stage), ()))
                    if count != 1:
                        raise ValueError(
                            f"{sch.name}: rank {owner[a.stage]} has {count} {a} actions; "
                            f"expected exactly one, to match {other} on rank {a.peer}"
                        )


def _check_order(sch: Schedule, where: dict[_Key, list[int]]) -> None:
    owner, last = sch.stage_to_rank, sch.num_stages - 1

    def pos(kind: ActionKind, mb: int, s: int) -> int | None:
        found = where.get((kind, mb, s))
        return found[0] if found else None

    def backward(mb: int, s: int) -> ActionKind:
        return K.BW if pos(K.BW, mb, s) is not None else K.B

    def after(later: _Key, earlier: _Key, why: str) -> None:
        i, j = pos(*later), pos(*earlier)
        if i is not None and j is not None and i < j:
            r = owner[later[2]]
            a, b = sch.actions[r][i], sch.actions[r][j]
            raise ValueError(
                f"{sch.name}: rank {r}: {a} at position {i} comes before {b} at position {j}, "
                f"but {why}"
            )

    for mb in range(sch.num_microbatches):
        for s in range(sch.num_stages):
            bk = backward(mb, s)
            f, b = (K.F, mb, s), (bk, mb, s)
            if s > 0:
                dep = (K.F, mb, s - 1) if owner[s - 1] == owner[s] else (K.RECV_F, mb, s)
                after(f, dep, "the forward needs its input")
            after((K.SEND_F, mb, s), f, "the send needs the forward's output")
            after(b, f, "the backward needs the forward's activations")
            if s < last:
                up = (backward(mb, s + 1), mb, s + 1)
                dep = up if owner[s + 1] == owner[s] else (K.RECV_B, mb, s)
                after(b, dep, "the backward needs the gradient of its output")
            after((K.SEND_B, mb, s), b, "the send needs the input gradient")
            if bk is K.B:
                after((K.W, mb, s), b, "W runs after B")


def _stuck_ranks(sch: Schedule, model: P2PModel) -> str:
    """Run all ranks under ``model``; describe the blocked ranks, or return '' if all finish."""
    acts = sch.actions
    ptr = [0] * sch.num_ranks
    sent: set[tuple[str, int, int]] = set()
    moved = True
    while moved:
        moved = False
        for r in range(sch.num_ranks):
            while ptr[r] < len(acts[r]):
                a = acts[r][ptr[r]]
                if a.is_compute:
                    ptr[r] += 1
                elif model is P2PModel.BUFFERED_SENDS:
                    if a.kind in _RECVS and a.message not in sent:
                        break
                    sent.add(a.message)
                    ptr[r] += 1
                else:
                    peer = a.peer if a.peer is not None else r
                    nxt = acts[peer][ptr[peer]] if ptr[peer] < len(acts[peer]) else None
                    if (nxt is None or nxt.is_compute or nxt.message != a.message
                            or (nxt.kind in _SENDS) == (a.kind in _SENDS)):
                        break
                    ptr[r] += 1
                    ptr[peer] += 1
                moved = True
    blocked = [
        f"rank {r} waits at {acts[r][ptr[r]]} (action {ptr[r]} of {len(acts[r])})"
        for r in range(sch.num_ranks)
        if ptr[r] < len(acts[r])
    ]
    return "; ".join(blocked)
