"""Pure shard arithmetic: which slice of a dimension each tensor-parallel rank holds.

Every function here is integer arithmetic (no process group is touched), so it is
property-tested without ranks. A dimension of ``size`` split over ``n`` ranks gives rank
``r`` the contiguous range ``[r * size / n, (r + 1) * size / n)``: the same chunks
``torch.chunk`` and the collectives of ``tessera.comm`` use.
"""

from __future__ import annotations

__all__ = ["check_divisible", "fused_shard_indices", "shard_range"]


def check_divisible(size: int, n: int, *, what: str, where: str) -> None:
    """Raise ValueError naming ``where``, ``what`` and both numbers unless ``n`` divides ``size``."""
    if n < 1:
        raise ValueError(f"{where}: tp must be >= 1, got {n}")
    if size % n:
        raise ValueError(f"{where}: {what}={size} is not divisible by tp={n}")


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
    check_divisible(size, sections, what=f"{what} (fused sections)", where=where)
    part = size // sections
    start, end = shard_range(part, n, rank, what=f"{what}/{sections}", where=where)
    return [s * part + i for s in range(sections) for i in range(start, end)]
