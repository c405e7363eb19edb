"""Which sequence positions each rank of a context-parallel group holds: pure functions.

``contiguous``: the sequence is cut into ``cp`` chunks and rank r holds chunk r. ``zigzag``:
it is cut into ``2*cp`` chunks and rank r holds chunks r and ``2*cp-1-r``, so under causal
attention every rank has the same amount of work (an early chunk attends to little, its
partner at the end to much). Positions are listed in the order the rank stores them.
The ``Layout`` enum and the chunk-count rule ``sequence_chunks`` are defined in
``tessera.comm.sequence_modes`` (importable without torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tessera.comm.sequence_modes import Layout, sequence_chunks

__all__ = [
    "Layout",
    "chunks_of",
    "local_positions",
    "rank_positions",
    "sequence_chunks",
    "split_sequence",
    "unsplit_sequence",
]


def _check(seq_len: int, cp: int, layout: Layout) -> int:
    """The chunk length, after checking that ``seq_len`` cuts evenly; ValueError otherwise."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    n = sequence_chunks(cp, layout)
    if seq_len < 0 or seq_len % n:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {n} chunks ({layout.value} layout, cp={cp})"
        )
    return seq_len // n


def chunks_of(rank: int, cp: int, layout: Layout | str) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in storage order (``cp`` or ``2*cp`` chunks in all)."""
    layout = Layout(layout)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the context-parallel group of {cp} ranks")
    return (rank, 2 * cp - 1 - rank) if layout is Layout.ZIGZAG else (rank,)


def rank_positions(rank: int, cp: int, seq_len: int, layout: Layout | str) -> list[int]:
    """The global positions (of a sequence of ``seq_len``) that ``rank`` holds, in storage order."""
    layout = Layout(layout)
    size = _check(seq_len, cp, layout)
    return [c * size + i for c in chunks_of(rank, cp, layout) for i in range(size)]


def local_positions(
    rank: int, cp: int, local_len: int, layout: Layout | str, device: torch.device | None = None
) -> Tensor:
    """``rank_positions`` for a rank holding ``local_len`` tokens, as a long tensor."""
    return torch.tensor(rank_positions(rank, cp, local_len * cp, layout), dtype=torch.long, device=device)


def split_sequence(x: Tensor, rank: int, cp: int, layout: Layout | str, dim: int = 1) -> Tensor:
    """The part of the full-sequence tensor ``x`` (sequence along ``dim``) that ``rank`` holds."""
    layout = Layout(layout)
    size = _check(x.shape[dim], cp, layout)
    parts = [x.narrow(dim, c * size, size) for c in chunks_of(rank, cp, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unsplit_sequence(parts: Sequence[Tensor], layout: Layout | str, dim: int = 1) -> Tensor:
    """The full sequence from every rank's part (in rank order): inverse of ``split_sequence``."""
    layout = Layout(layout)
    cp = len(parts)
    chunks: list[Tensor | None] = [None] * sequence_chunks(cp, layout)
    for rank, part in enumerate(parts):
        ids = chunks_of(rank, cp, layout)
        for c, piece in zip(ids, part.chunk(len(ids), dim), strict=True):
            chunks[c] = piece
    return torch.cat([c for c in chunks if c is not None], dim)
