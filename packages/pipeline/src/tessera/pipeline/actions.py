"""Pipeline schedules as data: the action vocabulary and the `Schedule` container.

A schedule lists, for every pipeline rank, the actions that rank performs in order. Compute
actions name a (microbatch, stage) pair; p2p actions also name the peer rank. Stages are
*virtual* stages numbered in model order ``0 .. num_stages - 1``; `Schedule.stage_to_rank`
says which rank holds each.

Conventions for p2p actions (the ``stage`` is always a stage held by the acting rank):

- ``SEND_F(mb, s, peer)`` sends the output activation of stage ``s`` to the rank of ``s + 1``;
  it matches ``RECV_F(mb, s + 1, peer=rank of s)`` there.
- ``SEND_B(mb, s, peer)`` sends the gradient w.r.t. the input of stage ``s`` to the rank of
  ``s - 1``; it matches ``RECV_B(mb, s - 1, peer=rank of s)`` there.

Neighbouring stages on the same rank exchange tensors locally and have no p2p actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["COMPUTE_KINDS", "P2P_KINDS", "Action", "ActionKind", "Schedule"]


class ActionKind(StrEnum):
    """What one action does."""

    F = "F"
    """Forward of one microbatch through one stage."""
    B = "B"
    """Backward for the input only (input gradient), when the backward is split."""
    W = "W"
    """Backward for the weights only (weight gradient), when the backward is split."""
    BW = "BW"
    """Full backward (input and weight gradients) when the backward is not split."""
    SEND_F = "SEND_F"
    """Send a stage's output activation to the next stage's rank."""
    RECV_F = "RECV_F"
    """Receive a stage's input activation from the previous stage's rank."""
    SEND_B = "SEND_B"
    """Send the gradient of a stage's input to the previous stage's rank."""
    RECV_B = "RECV_B"
    """Receive the gradient of a stage's output from the next stage's rank."""


COMPUTE_KINDS: frozenset[ActionKind] = frozenset(
    {ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW}
)
P2P_KINDS: frozenset[ActionKind] = frozenset(
    {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: a compute on (microbatch, stage), or a p2p transfer with a peer."""

    kind: ActionKind
    microbatch: int
    stage: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.microbatch < 0 or self.stage < 0:
            raise ValueError(
                f"{self.kind} needs microbatch >= 0 and stage >= 0; "
                f"got microbatch={self.microbatch}, stage={self.stage}"
            )
        if self.kind in P2P_KINDS:
            if self.peer is None or self.peer < 0:
                raise ValueError(f"{self.kind} needs a peer rank >= 0; got peer={self.peer}")
        elif self.peer is not None:
            raise ValueError(f"compute action {self.kind} takes no peer; got peer={self.peer}")

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW."""
        return self.kind in COMPUTE_KINDS

    @property
    def message(self) -> tuple[str, int, int]:
        """For p2p actions, the tensor moved: (``"F"`` or ``"B"``, microbatch, sending stage).

        A send and a receive match exactly when their messages are equal.
        """
        mb, s = self.microbatch, self.stage
        if self.kind is ActionKind.SEND_F:
            return ("F", mb, s)
        if self.kind is ActionKind.RECV_F:
            return ("F", mb, s - 1)
        if self.kind is ActionKind.SEND_B:
            return ("B", mb, s)
        if self.kind is ActionKind.RECV_B:
            return ("B", mb, s + 1)
        raise ValueError(f"{self} is a compute action; only p2p actions carry a message")

    def __str__(self) -> str:
        base = f"{self.kind}{self.microbatch}s{self.stage}"
        if self.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            return f"{base}>r{self.peer}"
        if self.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            return f"{base}<r{self.peer}"
        return base


@dataclass(frozen=True, slots=True)
class Schedule:
    """A complete pipeline schedule: the ordered actions of every rank for one step.

    ``actions[r]`` is rank ``r``'s action list; ``stage_to_rank[s]`` is the rank holding
    virtual stage ``s``. The constructor checks only the shape; `validate` checks the content.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    num_stages: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_microbatches < 1 or self.num_stages < 1:
            raise ValueError(
                "a schedule needs num_ranks, num_microbatches and num_stages >= 1; got "
                f"{self.num_ranks}, {self.num_microbatches}, {self.num_stages}"
            )
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for "
                f"{self.num_stages} stages"
            )
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(f"stage_to_rank names ranks {bad} outside 0..{self.num_ranks - 1}")
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"actions has {len(self.actions)} rank lists for {self.num_ranks} ranks"
            )

    @property
    def chunks_per_rank(self) -> int:
        """Virtual stages per rank (``num_stages // num_ranks``)."""
        return self.num_stages // self.num_ranks

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into B (input grad) and W (weight grad)."""
        return any(a.kind is ActionKind.W for acts in self.actions for a in acts)

    def split_units(self) -> frozenset[tuple[int, int]]:
        """The (microbatch, stage) units whose backward is split (they have a W)."""
        w = ActionKind.W
        return frozenset((a.microbatch, a.stage) for acts in self.actions for a in acts if a.kind is w)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages held by ``rank``, in model order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s compute actions (F, B, W, BW) in order, without p2p."""
        return tuple(a for a in self.actions[rank] if a.is_compute)

    def __str__(self) -> str:
        head = (
            f"{self.name}: p={self.num_ranks} m={self.num_microbatches} "
            f"stages={self.num_stages}"
        )
        rows = [f"r{r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])
