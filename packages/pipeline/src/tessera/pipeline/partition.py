"""Split a model, given as a sequence of blocks, into balanced contiguous pipeline stages.

The model is a sequence of ``n`` blocks with a non-negative cost each (parameter count,
estimated cost, or measured seconds). It is cut into ``num_stages = num_ranks *
chunks_per_rank`` contiguous, non-empty *virtual stages* so that the largest stage cost is as
small as possible (exact optimum, by dynamic programming; among optimal splits, each
stage boundary is placed as early as possible from the last stage backwards, so later stages
are as long as the optimum allows).

Where each virtual stage lives is the `Layout`:

- `Layout.LOOP` (GPipe, 1F1B, interleaved 1F1B): virtual stage ``s`` lives on rank
  ``s % num_ranks``; rank ``r`` holds stages ``r, r + p, r + 2p, ...`` (chunk ``c`` of rank
  ``r`` is stage ``c * p + r``). With one chunk per rank, stage ``s`` is rank ``s``.
- `Layout.V` (ZBV): chunks go down the ranks and back up, so with two chunks rank ``r``
  holds stages ``r`` and ``2p - 1 - r``; rank ``p - 1`` holds the turn (stages ``p - 1`` and
  ``p``) and rank 0 holds the first and the last stage. More chunks keep zig-zagging.

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

__all__ = [
    "Balance",
    "Layout",
    "Partition",
    "partition_by_cost",
    "partition_by_params",
    "partition_by_profile",
    "rank_of_stage",
    "stage_to_rank",
]

logger = logging.getLogger(__name__)


class Layout(StrEnum):
    """How virtual stages are placed on ranks."""

    LOOP = "loop"
    """Stage ``s`` on rank ``s % p`` (GPipe, 1F1B, interleaved 1F1B)."""
    V = "v"
    """Down the ranks then back up: with 2 chunks rank ``r`` holds ``r`` and ``2p-1-r`` (ZBV)."""


class Balance(StrEnum):
    """What the block costs of a `Partition` measured."""

    PARAMS = "params"
    COST = "cost"
    PROFILE = "profile"


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


@dataclass(frozen=True, slots=True)
class Partition:
    """A contiguous split of ``num_blocks`` blocks into virtual stages placed on ranks.

    ``ranges[s] = (start, stop)`` is the half-open block range of virtual stage ``s``;
    ``costs[s]`` is its total cost; ``block_costs`` are the inputs.
    """

    ranges: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]
    block_costs: tuple[float, ...]
    num_ranks: int
    chunks_per_rank: int = 1
    layout: Layout = Layout.LOOP
    balance: Balance = Balance.COST

    def __post_init__(self) -> None:
        _check_grid(self.num_ranks, self.chunks_per_rank)
        if len(self.ranges) != self.num_ranks * self.chunks_per_rank:
            raise ValueError(
                f"{len(self.ranges)} ranges for num_ranks={self.num_ranks} x "
                f"chunks_per_rank={self.chunks_per_rank} stages"
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
        """Number of virtual stages (``num_ranks * chunks_per_rank``)."""
        return len(self.ranges)

    @property
    def num_blocks(self) -> int:
        """Number of blocks partitioned."""
        return len(self.block_costs)

    @property
    def max_cost(self) -> float:
        """The cost of the most expensive stage (what the partition minimises)."""
        return max(self.costs)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        """The rank of every virtual stage under this partition's layout."""
        return stage_to_rank(self.layout, self.num_ranks, self.chunks_per_rank)

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
    num_ranks: int,
    *,
    chunks_per_rank: int = 1,
    layout: Layout = Layout.LOOP,
) -> Partition:
    """Split blocks with the given non-negative ``costs`` into balanced contiguous stages.

    Minimises the maximum virtual-stage cost over all contiguous splits into
    ``num_ranks * chunks_per_rank`` non-empty stages (exact).
    """
    return _partition(costs, num_ranks, chunks_per_rank, layout, Balance.COST)


def partition_by_profile(
    seconds: Sequence[float],
    num_ranks: int,
    *,
    chunks_per_rank: int = 1,
    layout: Layout = Layout.LOOP,
) -> Partition:
    """Like `partition_by_cost`, with measured seconds per block (forward + backward)."""
    return _partition(seconds, num_ranks, chunks_per_rank, layout, Balance.PROFILE)


def partition_by_params(
    blocks: Sequence[nn.Module] | Sequence[int],
    num_ranks: int,
    *,
    chunks_per_rank: int = 1,
    layout: Layout = Layout.LOOP,
) -> Partition:
    """Balance stages by parameter count: ``blocks`` are modules, or their counts as ints.

    A module's count is the number of elements of ``module.parameters()`` (a parameter shared
    by two blocks counts in both).
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
    return _partition(counts, num_ranks, chunks_per_rank, layout, Balance.PARAMS)


def _check_grid(num_ranks: int, chunks_per_rank: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1; got {num_ranks}")
    if chunks_per_rank < 1:
        raise ValueError(f"chunks_per_rank must be >= 1; got {chunks_per_rank}")


def _partition(
    costs: Sequence[float],
    num_ranks: int,
    chunks_per_rank: int,
    layout: Layout,
    balance: Balance,
) -> Partition:
    _check_grid(num_ranks, chunks_per_rank)
    values = tuple(float(c) for c in costs)
    for i, c in enumerate(values):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"block {i} has cost {c}; costs must be finite and >= 0")
    num_stages = num_ranks * chunks_per_rank
    if len(values) < num_stages:
        raise ValueError(
            f"cannot split {len(values)} blocks into {num_stages} stages (num_ranks="
            f"{num_ranks} x chunks_per_rank={chunks_per_rank}): each stage needs a block"
        )
    bounds = _min_max_split(values, num_stages)
    ranges = tuple(itertools.pairwise(bounds))
    stage_costs = tuple(math.fsum(values[a:b]) for a, b in ranges)
    part = Partition(ranges, stage_costs, values, num_ranks, chunks_per_rank, layout, balance)
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
