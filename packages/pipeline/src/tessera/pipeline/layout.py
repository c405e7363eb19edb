"""Where virtual stages live: the `Layout` of a schedule and its stage-to-rank arithmetic.

A model cut into ``p * v`` *virtual stages* (``v`` chunks per rank) places them on ``p``
ranks by a layout:

- `Layout.LOOP` (GPipe, 1F1B, interleaved 1F1B): virtual stage ``s`` lives on rank
  ``s % p``; rank ``r`` holds stages ``r, r + p, r + 2p, ...`` (chunk ``c`` of rank ``r`` is
  stage ``c * p + r``). With one chunk per rank, stage ``s`` is rank ``s``.
- `Layout.V` (ZBV): chunks go down the ranks and back up, so with two chunks rank ``r``
  holds stages ``r`` and ``2p - 1 - r``; rank ``p - 1`` holds the turn (stages ``p - 1`` and
  ``p``) and rank 0 holds the first and the last stage. More chunks keep zig-zagging.

Pure integer arithmetic. A schedule's layout is part of its `ScheduleSpec`; callers ask the
spec (``spec.stage_to_rank(p, v)``) or a built schedule (``schedule.stage_to_rank``).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Layout", "rank_of_stage", "stage_to_rank"]


class Layout(StrEnum):
    """How virtual stages are placed on ranks."""

    LOOP = "loop"
    """Stage ``s`` on rank ``s % p`` (GPipe, 1F1B, interleaved 1F1B)."""
    V = "v"
    """Down the ranks then back up: with 2 chunks rank ``r`` holds ``r`` and ``2p-1-r`` (ZBV)."""


def rank_of_stage(layout: Layout, stage: int, num_ranks: int, chunks_per_rank: int = 1) -> int:
    """The rank holding virtual ``stage`` of ``num_ranks * chunks_per_rank`` under ``layout``."""
    _check_grid(num_ranks, chunks_per_rank)
    num_stages = num_ranks * chunks_per_rank
    if not 0 <= stage < num_stages:
        raise ValueError(
            f"stage {stage} is outside 0..{num_stages - 1} "
            f"(num_ranks={num_ranks} x chunks_per_rank={chunks_per_rank})"
        )
    chunk, pos = divmod(stage, num_ranks)
    if layout is Layout.LOOP or chunk % 2 == 0:
        return pos
    return num_ranks - 1 - pos


def stage_to_rank(layout: Layout, num_ranks: int, chunks_per_rank: int = 1) -> tuple[int, ...]:
    """The rank of every virtual stage, in stage order (see `Layout`)."""
    _check_grid(num_ranks, chunks_per_rank)
    return tuple(
        rank_of_stage(layout, s, num_ranks, chunks_per_rank)
        for s in range(num_ranks * chunks_per_rank)
    )


def _check_grid(num_ranks: int, chunks_per_rank: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1; got {num_ranks}")
    if chunks_per_rank < 1:
        raise ValueError(f"chunks_per_rank must be >= 1; got {chunks_per_rank}")
