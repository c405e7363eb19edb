"""Pure shard arithmetic: where tensors sit in one padded flat buffer, and how it splits over ranks.

A ``FlatLayout`` lays tensors of the given element counts end to end, then pads the buffer
so that it splits into ``world_size`` equal shards whose length is a multiple of ``align``
elements. Rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``. ``bucketize`` cuts a
sequence of sizes into consecutive buckets under a byte cap. No processes, no tensors: these
are property-tested on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BUCKET_BYTES", "FlatLayout", "bucketize"]

BUCKET_BYTES = 25 * 2**20
"""Bytes of a stage 0-2 bucket unless ``ZeroOptimizer(bucket_bytes=...)`` says otherwise."""


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Offsets of ``numels`` in a flat buffer padded to ``world_size`` equal shards.

    The shard length is the smallest positive multiple of ``align`` whose ``world_size``-fold
    holds every element, so each rank owns at least ``align`` elements and the padding is
    below ``world_size * align`` elements.
    """

    numels: tuple[int, ...]
    world_size: int
    align: int = 1
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)
    shard_numel: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.align < 1:
            raise ValueError(f"align must be >= 1, got {self.align}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"element counts must be >= 0, got {self.numels}")
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        unit = self.world_size * self.align
        shard = max(1, -(-total // unit)) * self.align
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)
        object.__setattr__(self, "shard_numel", shard)

    @property
    def padded_numel(self) -> int:
        """Length of the flat buffer: ``world_size * shard_numel``."""
        return self.world_size * self.shard_numel

    @property
    def padding(self) -> int:
        """Elements of padding at the end of the buffer."""
        return self.padded_numel - self.numel

    def span(self, index: int) -> tuple[int, int]:
        """``[start, stop)`` of tensor ``index`` in the flat buffer."""
        start = self.offsets[index]
        return start, start + self.numels[index]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the flat buffer that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owners(self, index: int) -> tuple[int, ...]:
        """The ranks whose shards hold part of tensor ``index`` (none for an empty tensor)."""
        start, stop = self.span(index)
        if stop == start:
            return ()
        return tuple(range(start // self.shard_numel, (stop - 1) // self.shard_numel + 1))


def bucketize(sizes: Sequence[int], cap: int) -> list[tuple[int, ...]]:
    """Cut indices ``0..len(sizes)-1`` into consecutive buckets whose sizes sum to at most
    ``cap``; an item larger than ``cap`` gets a bucket of its own. Every index appears once,
    in order."""
    if cap < 1:
        raise ValueError(f"bucket cap must be >= 1, got {cap}")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sizes must be >= 0, got {size} at {i}")
        if current and filled + size > cap:
            buckets.append(tuple(current))
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(tuple(current))
    return buckets
