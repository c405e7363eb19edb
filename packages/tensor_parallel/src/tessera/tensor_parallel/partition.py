"""Pure shard arithmetic: which slice of a dimension each tensor-parallel rank holds.

Every function here is integer arithmetic (no process group is touched), so it is
property-tested without ranks. A dimension of ``size`` split over ``n`` ranks gives rank
``r`` the contiguous range ``[r * size / n, (r + 1) * size / n)``: the same chunks
``torch.chunk`` and the collectives of ``tessera.comm`` use. ``ShardSpec`` says how one
serial tensor maps to every rank's shard and back (``shard`` / ``unshard``, both pure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ShardSpec", "check_divisible", "fused_shard_indices", "shard_range"]


def check_divisible(size: int, n: int, *, what: str, where: str, by: str = "tp") -> None:
    """Raise ValueError naming ``where``, ``what`` and both numbers unless ``n`` divides ``size``
    (``by`` names ``n``: tp unless told, e.g. the fused sections or the heads of a layer)."""
    if n < 1:
        raise ValueError(f"{where}: {by} must be >= 1, got {n}")
    if size % n:
        raise ValueError(f"{where}: {what}={size} is not divisible by {by}={n}")


def shard_range(size: int, n: int, rank: int, *, what: str = "size", where: str = "shard") -> tuple[int, int]:
    """The half-open range ``(start, end)`` of ``size`` that rank ``rank`` of ``n`` holds."""
    check_divisible(size, n, what=what, where=where)
    if not 0 <= rank < n:
        raise ValueError(f"{where}: rank {rank} is outside [0, {n})")
    per = size // n
    return rank * per, (rank + 1) * per


def fused_shard_indices(
    size: int, sections: int, n: int, rank: int, *, what: str = "size", where: str = "shard"
) -> list[int]:
    """Indices rank ``rank`` holds of a dimension made of ``sections`` equal parts (fused q, k, v):
    its shard of every part, parts kept in order, so each rank's slice is itself fused."""
    check_divisible(size, sections, what=what, where=where, by="sections (fused parts)")
    part = size // sections
    if n >= 1 and part % n:
        raise ValueError(
            f"{where}: {what}/{sections}={part} (each of the {sections} fused sections) "
            f"is not divisible by tp={n}"
        )
    start, end = shard_range(part, n, rank, what=f"{what}/{sections}", where=where)
    return [s * part + i for s in range(sections) for i in range(start, end)]


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How a serial tensor is split over tp ranks: along its dim ``dim``, as ``sections``
    equal fused parts each split (fused q|k|v: ``sections=3``), rank ``r`` holding its chunk of
    every part in order. ``transposed``: the shard is stored transposed (a 2-D HF ``Conv1D``
    weight, held by the parallel layer in nn.Linear layout)."""

    dim: int
    sections: int = 1
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.sections < 1 or self.dim < 0 or (self.transposed and self.dim > 1):
            raise ValueError(f"invalid {self}: dim >= 0 (0 or 1 if transposed) and sections >= 1")

    @property
    def local_dim(self) -> int:
        """The split dim of the shard as stored (differs from ``dim`` when transposed)."""
        return 1 - self.dim if self.transposed else self.dim

    def __str__(self) -> str:
        fused = f" in {self.sections} sections" if self.sections > 1 else ""
        return f"dim{self.dim}{fused}{' (stored transposed)' if self.transposed else ''}"

    def replicas(self, tp: int) -> int:
        """How many of the ``tp`` ranks hold an identical copy of each element of the tensor:
        1 for a partition (every element on exactly one rank)."""
        return 1

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        """Rank ``rank``'s shard of the serial tensor ``full`` over ``tp`` ranks."""
        where = f"shard {tuple(full.shape)} along {self}"
        index = fused_shard_indices(int(full.shape[self.dim]), self.sections, tp, rank, where=where)
        part = full.index_select(self.dim, torch.tensor(index, device=full.device))
        return part.t() if self.transposed else part

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """The serial tensor from every rank's shard, in rank order (inverse of ``shard``)."""
        parts = [s.t() if self.transposed else s for s in shards]
        chunks = [p.chunk(self.sections, self.dim) for p in parts]
        return torch.cat([c[s] for s in range(self.sections) for c in chunks], self.dim).contiguous()
