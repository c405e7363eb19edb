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
    once filled): at stage 3 in fp32 it also owns the parameter shards (the masters); the
    optimizer is rewired to its chunks."""
    owns = stage == 3 and flats[0].compute_dtype == torch.float32
    return ChunkStore(
        model, flats, optimizer, config, owns_shards=owns, weights=weights, label=f"rank{group_rank(group)}"
    )
