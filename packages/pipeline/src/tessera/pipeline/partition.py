"""Split a model, given as a sequence of blocks, into balanced contiguous pipeline stages.

The model is a sequence of ``n`` blocks with a non-negative cost each (parameter count,
estimated cost, or measured seconds). It is cut into as many contiguous, non-empty *virtual
stages* as the placement names, so that the largest stage cost is as small as possible
(exact optimum, by dynamic programming; among optimal splits, each stage boundary is placed as
early as possible from the last stage backwards, so later stages are as long as the optimum
allows). With several stages per rank (interleaved, V) the busiest *rank* can still carry far
more than the others; ``balance_ranks=True`` then moves boundaries to even the ranks out.

Where each virtual stage lives comes from the schedule that will run the stages, so nothing
here restates a layout:

    schedule = build_schedule("zbv", p, m)
    part = partition_by_params(blocks, schedule=schedule)

or give the *placement* (``placement[s]`` = rank of stage ``s``) directly: before building a
schedule, ``schedule_spec(name).stage_to_rank(p, v)``; one stage per rank, ``range(p)``.

All of this is pure integer and float arithmetic: no processes, no torch.distributed.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from tessera.pipeline.actions import Schedule

__all__ = [
    "Balance",
    "Partition",
    "partition_by_cost",
    "partition_by_params",
    "partition_by_profile",
]

logger = logging.getLogger(__name__)


class Balance(StrEnum):
    """What the block costs of a `Partition` measured."""

    PARAMS = "params"
    COST = "cost"
    PROFILE = "profile"


@dataclass(frozen=True, slots=True)
class Partition:
    """A contiguous split of ``num_blocks`` blocks into virtual stages placed on ranks.

    ``ranges[s] = (start, stop)`` is the half-open block range of virtual stage ``s``;
    ``costs[s]`` is its total cost; ``block_costs`` are the inputs; ``stage_to_rank[s]`` is
    the rank holding stage ``s`` (every rank ``0 .. num_ranks - 1`` holds at least one).
    """

    ranges: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]
    block_costs: tuple[float, ...]
    stage_to_rank: tuple[int, ...]
    balance: Balance = Balance.COST

    def __post_init__(self) -> None:
        _check_placement(self.stage_to_rank)
        if len(self.ranges) != len(self.stage_to_rank):
            raise ValueError(
                f"{len(self.ranges)} ranges for {len(self.stage_to_rank)} placed stages"
            )
        if len(self.costs) != len(self.ranges):
            raise ValueError(f"{len(self.costs)} costs for {len(self.ranges)} stages")
        expect = 0
        for s, (start, stop) in enumerate(self.ranges):
            if start != expect or stop <= start:
                raise ValueError(
                    f"stage {s} has block range [{start}, {stop}); ranges must be non-empty "
                    f"and contiguous from block {expect}"
                )
            expect = stop
        if expect != len(self.block_costs):
            raise ValueError(f"ranges cover {expect} blocks of {len(self.block_costs)}")

    @property
    def num_stages(self) -> int:
        """Number of virtual stages."""
        return len(self.ranges)

    @property
    def num_ranks(self) -> int:
        """Number of ranks holding stages."""
        return max(self.stage_to_rank) + 1

    @property
    def num_blocks(self) -> int:
        """Number of blocks partitioned."""
        return len(self.block_costs)

    @property
    def max_cost(self) -> float:
        """The cost of the most expensive stage (what the partition minimises)."""
        return max(self.costs)

    @property
    def rank_costs(self) -> tuple[float, ...]:
        """Total cost held by each rank (sum over its chunks)."""
        totals = [0.0] * self.num_ranks
        for s, rank in enumerate(self.stage_to_rank):
            totals[rank] += self.costs[s]
        return tuple(totals)

    def blocks_of_stage(self, stage: int) -> range:
        """The block indices of virtual ``stage``."""
        start, stop = self.ranges[stage]
        return range(start, stop)

    def stage_of_block(self, block: int) -> int:
        """The virtual stage that holds ``block``."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is outside 0..{self.num_blocks - 1}")
        return bisect.bisect_right([start for start, _ in self.ranges], block) - 1

    def rank_of_block(self, block: int) -> int:
        """The rank that holds ``block``."""
        return self.stage_to_rank[self.stage_of_block(block)]

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The virtual stages held by ``rank``, in model order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)


def partition_by_cost(
    costs: Sequence[float],
    placement: Sequence[int] | None = None,
    *,
    schedule: Schedule | None = None,
    balance_ranks: bool = True,
) -> Partition:
    """Split blocks with the given non-negative ``costs`` into balanced contiguous stages.

    The stages and their ranks are ``schedule.stage_to_rank`` or, without a schedule,
    ``placement`` (stage ``s`` on rank ``placement[s]``); give exactly one. Minimises the
    maximum virtual-stage cost over all contiguous splits into that many non-empty stages
    (exact). ``balance_ranks`` (default): with several stages per rank, then move stage
    boundaries while that lowers the largest *rank* cost (never worse than the
    stage-balanced split; a local optimum, see ``_balance_ranks``); with one stage per rank
    it changes nothing. ``balance_ranks=False``: the stage-balanced split alone.
    """
    return _partition(costs, _stage_ranks(placement, schedule), Balance.COST, balance_ranks)


def partition_by_profile(
    seconds: Sequence[float],
    placement: Sequence[int] | None = None,
    *,
    schedule: Schedule | None = None,
    balance_ranks: bool = True,
) -> Partition:
    """Like `partition_by_cost`, with measured seconds per block (forward + backward)."""
    return _partition(seconds, _stage_ranks(placement, schedule), Balance.PROFILE, balance_ranks)


def partition_by_params(
    blocks: Sequence[nn.Module] | Sequence[int],
    placement: Sequence[int] | None = None,
    *,
    schedule: Schedule | None = None,
    balance_ranks: bool = True,
) -> Partition:
    """Balance stages by parameter count: ``blocks`` are modules, or their counts as ints.

    A module's count is the number of elements of ``module.parameters()`` (a parameter shared
    by two blocks counts in both). ``placement``, ``schedule`` and ``balance_ranks`` as in
    `partition_by_cost`.
    """
    counts: list[float] = []
    items: Sequence[nn.Module | int] = blocks
    for i, block in enumerate(items):
        if isinstance(block, bool):
            raise ValueError(f"block {i} is a bool, not a module or a parameter count")
        if isinstance(block, int):
            counts.append(float(block))
        else:
            counts.append(float(sum(p.numel() for p in block.parameters())))
    return _partition(counts, _stage_ranks(placement, schedule), Balance.PARAMS, balance_ranks)


def _stage_ranks(placement: Sequence[int] | None, schedule: Schedule | None) -> tuple[int, ...]:
    """The rank of every stage, from exactly one of ``placement`` and ``schedule``."""
    if placement is None and schedule is not None:
        return schedule.stage_to_rank
    if placement is None or schedule is not None:
        raise ValueError(
            "give exactly one of placement (the rank of every stage) and schedule; got "
            f"placement={placement!r}, schedule={None if schedule is None else schedule.name!r}"
        )
    if isinstance(placement, int):
        raise TypeError(
            f"placement is the rank of every stage (e.g. range(p)); got the int {placement}"
        )
    return tuple(placement)


def _check_placement(ranks: tuple[int, ...]) -> None:
    if not ranks:
        raise ValueError("a placement needs at least one stage; got none")
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if min(ranks) < 0 or missing:
        raise ValueError(
            f"placement {ranks} must put every stage on a rank >= 0 and every rank "
            f"0..{max(ranks)} must hold a stage; ranks without a stage: {missing}"
        )


def _partition(
    costs: Sequence[float], ranks: tuple[int, ...], balance: Balance, balance_ranks: bool
) -> Partition:
    _check_placement(ranks)
    values = tuple(float(c) for c in costs)
    for i, c in enumerate(values):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"block {i} has cost {c}; costs must be finite and >= 0")
    num_stages = len(ranks)
    if len(values) < num_stages:
        raise ValueError(
            f"cannot split {len(values)} blocks into {num_stages} stages: each stage needs a block"
        )
    bounds = _min_max_split(values, num_stages)
    if balance_ranks:
        bounds = _balance_ranks(values, bounds, ranks)
    ranges = tuple(itertools.pairwise(bounds))
    stage_costs = tuple(math.fsum(values[a:b]) for a, b in ranges)
    part = Partition(ranges, stage_costs, values, ranks, balance)
    logger.debug("partitioned %d blocks by %s: ranges=%s", len(values), balance, ranges)
    return part


def _min_max_split(values: tuple[float, ...], k: int) -> list[int]:
    """Stage boundaries ``0 = b0 < b1 < ... < bk = n`` minimising the largest stage sum.

    ``best[j]`` (for the current number of stages t) is the optimal largest sum when the
    first ``j`` blocks form t stages. It is non-decreasing in ``j`` (costs are non-negative),
    while the last stage's sum ``prefix[i] - prefix[j]`` is non-increasing in ``j``, so the
    best split of ``i`` blocks sits where the two cross: a binary search, O(k n log n).
    """
    n = len(values)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    best: list[float] = prefix[:]  # one stage: the sum of the first j blocks
    choices: list[list[int]] = []  # choices[t - 2][i]: start of the last stage, t stages
    for t in range(2, k + 1):
        new = [math.inf] * (n + 1)
        choice = [0] * (n + 1)
        for i in range(t, n - (k - t) + 1):
            lo, hi = t - 1, i - 1  # the last stage is blocks [j, i), j in [lo, hi]
            # smallest j in [lo, hi] with best[j] >= prefix[i] - prefix[j]
            a, b = lo, hi + 1
            while a < b:
                mid = (a + b) // 2
                if best[mid] >= prefix[i] - prefix[mid]:
                    b = mid
                else:
                    a = mid + 1
            candidates = [j for j in (a - 1, a) if lo <= j <= hi]
            j_best = min(candidates, key=lambda j: (max(best[j], prefix[i] - prefix[j]), j))
            new[i] = max(best[j_best], prefix[i] - prefix[j_best])
            choice[i] = j_best
        best = new
        choices.append(choice)
    bounds = [n]
    for choice in reversed(choices):
        bounds.append(choice[bounds[-1]])
    bounds.append(0)
    return bounds[::-1]


def _balance_ranks(values: tuple[float, ...], bounds: list[int], ranks: tuple[int, ...]) -> list[int]:
    """Move stage boundaries while that lowers (largest rank cost, largest stage cost).

    With several stages per rank (interleaved, V), the stage-balanced split can load one rank
    far more than another: in the V layout rank ``r`` holds stages ``r`` and ``2p - 1 - r``,
    so for ``[embed, 6 layers, head]`` on p = 2 the middle rank gets four layers. Coordinate
    descent from the stage-balanced split: for each boundary in turn, the position that
    lowers the pair the most, until no boundary moves. Never worse than the start (a local
    optimum, not a proven one); a no-op with one stage per rank, where it is already exact.
    """
    if len(set(ranks)) == len(ranks):
        return bounds
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)

    def score(b: list[int]) -> tuple[float, float]:
        stage = [prefix[b[i + 1]] - prefix[b[i]] for i in range(len(ranks))]
        per_rank: dict[int, float] = {}
        for r, c in zip(ranks, stage, strict=True):
            per_rank[r] = per_rank.get(r, 0.0) + c
        return max(per_rank.values()), max(stage)

    best, current = score(bounds), list(bounds)
    moved = True
    while moved:
        moved = False
        for i in range(1, len(current) - 1):
            for pos in range(current[i - 1] + 1, current[i + 1]):
                trial = [*current[:i], pos, *current[i + 1 :]]
                if (s := score(trial)) < best:
                    best, current, moved = s, trial, True
    return current
