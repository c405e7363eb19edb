"""``build_store``: the ChunkStore of a ZeroOptimizer's FlatParams (``take`` each once filled)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tessera.comm import Group, group_rank
from tessera.zero.chunks.config import ChunkConfig
from tessera.zero.chunks.store import ChunkStore, Pieces
from tessera.zero.flat_param import FlatParam

__all__ = ["build_store"]


def build_store(
    model: nn.Module,
    flats: Sequence[FlatParam],
    optimizer: torch.optim.Optimizer,
    config: ChunkConfig,
    *,
    stage: int,
    group: Group,
    weights: Sequence[Pieces] | None,
) -> ChunkStore:
    """The ChunkStore of ``flats`` (``ChunkedFlatParam``s, handed to it by ``ChunkStore.take``
    once filled): at stage 3 it also owns the parameter shards that are their masters (in
    fp32, and frozen ones); the optimizer is rewired to its chunks."""
    return ChunkStore(
        model, flats, optimizer, config, stage3=stage == 3, weights=weights, label=f"rank{group_rank(group)}"
    )
