"""Chunks: fixed-size pieces of each FlatParam shard, and where each one lives.

A chunk covers the elements ``[lo, hi)`` of one FlatParam's shard on this rank (chunks never
cross FlatParams, so a shard's last chunk may be shorter) and holds, for them, every
*stream* of model data the optimizer needs: the fp32 master (in fp32 at stage 3 also the
parameter shard itself), the fp32 gradient while one exists, and each optimizer state
tensor (Adam: ``exp_avg``, ``exp_avg_sq``). A *frozen* chunk (of a frozen FlatParam, whose
parameters take no gradient) holds one stream, ``master``, in the compute dtype: the values
the model computes with, which nothing steps. Chunks are ZeRO-sharded because shards are:
each rank chunks only its own shard. ``plan_chunks`` is pure arithmetic over integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import Tensor, nn

__all__ = ["Chunk", "ChunkState", "Tier", "plan_chunks"]


class Tier(Enum):
    """Where a chunk's streams live between uses, fastest first."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class ChunkState(Enum):
    """A chunk's life cycle: resident on its tier, being brought to compute, or in use."""

    RESIDENT = "resident"  # streams held on DEVICE/HOST, or written to DISK files
    LOADING = "loading"  # a prefetch is reading it from disk
    IN_USE = "in use"  # its streams are loaded for compute (step, gradient write, gather)


def plan_chunks(shard_numels: Sequence[int], chunk_numel: int) -> list[tuple[int, int, int]]:
    """``(flat_index, lo, hi)`` for every chunk: each shard of ``shard_numels`` cut into
    pieces of ``chunk_numel`` elements (the last piece of a shard holds the rest)."""
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
    out: list[tuple[int, int, int]] = []
    for fi, n in enumerate(shard_numels):
        if n < 0:
            raise ValueError(f"shard {fi} has {n} elements")
        out.extend((fi, lo, min(lo + chunk_numel, n)) for lo in range(0, n, chunk_numel))
    return out


@dataclass(eq=False)
class Chunk:
    """One chunk: its range, its home tier, its state, and the streams held in memory.

    ``dtype``: the dtype of every stream it holds (fp32; a frozen chunk's compute dtype).
    ``streams`` maps a stream name to its tensor while the chunk is resident in memory (its
    tier is DEVICE or HOST) or in use; a DISK chunk holds none between uses. ``param`` is the
    placeholder the optimizer steps (its data and state point at the streams during the
    step, at nothing otherwise); ``scalars`` keeps the optimizer's 0-d state (Adam's step).
    """

    index: int
    flat_index: int
    group_index: int
    lo: int
    hi: int
    tier: Tier
    param: nn.Parameter
    dtype: torch.dtype = torch.float32
    frozen: bool = False
    state: ChunkState = ChunkState.RESIDENT
    streams: dict[str, Tensor] = field(default_factory=dict)
    on_disk: set[str] = field(default_factory=set)
    scalars: dict[str, object] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        """Elements per stream."""
        return self.hi - self.lo

    def __repr__(self) -> str:
        return (
            f"Chunk({self.index}: flat {self.flat_index}{' (frozen)' if self.frozen else ''} "
            f"[{self.lo}, {self.hi}), {self.tier.value}, "
            f"{self.state.value}, streams={sorted(set(self.streams) | self.on_disk)})"
        )
