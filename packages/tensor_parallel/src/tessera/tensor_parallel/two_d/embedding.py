"""2D embedding, split on the hidden dimension over the whole q x q grid (Colossal-AI's
``Embedding2D``).

The serial weight (vocab, hidden) is cut along the hidden into q*q chunks; rank (i, j) holds
chunk ``j*q + i``. Forward all-gathers the chunks along column j, giving hidden block j of
the whole vocabulary, and looks up this rank's tokens (its batch block i): the output
(..., hidden/q) is in the 2D activation layout. Backward: the dense gradient of that block
(the sum over this rank's tokens) is reduce-scattered along the column, summing over the
batch rows: exact.

Cost per rank, ``|E| = vocab * hidden * e`` the serial weight's bytes: forward ``|E|/q``
(all-gather output), backward ``|E|/q`` (reduce-scatter input). The ids need not be batch
ids: a position embedding looks up ``arange(seq)`` on every rank and broadcasts over the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import all_gather_along
from tessera.tensor_parallel.embedding import EmbedScale, embed_scale_of, keep_embed_scale, scaled
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.style import module_kind
from tessera.tensor_parallel.two_d.grid import Grid2D, GridShardSpec, check_grid_divisible

__all__ = ["EMBEDDING_SPEC", "Embedding2D", "check_plain_embedding", "embedding_twin"]

M = TypeVar("M", bound=nn.Module)


def check_plain_embedding(module: nn.Module, where: str) -> nn.Embedding:
    """``module`` as an nn.Embedding of plain lookups, what the 2D and 3D embeddings take
    (ValueError naming ``where`` for another module, or a padding_idx, max_norm or sparse one)."""
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"{where}: expected torch.nn.Embedding, got {module_kind(module)}")
    if module.padding_idx is not None or module.max_norm is not None or module.sparse:
        raise ValueError(f"{where}: padding_idx, max_norm and sparse are not supported")
    return module


def embedding_twin(
    cls: Callable[..., M], embedding: nn.Embedding, layout: Any, spec: ShardSpec, rank: int, tp: int
) -> M:
    """``cls(vocab, hidden, layout, dtype=, device=, embed_scale=)`` holding tp rank ``rank``'s
    shard (by ``spec`` over ``tp`` ranks) of ``embedding``'s weight and its scale if it is a scaled
    embedding (``embed_scale_of``): the ``from_dense`` of the 2D and 3D embeddings. ValueError for
    a padding_idx, max_norm or sparse embedding (not supported)."""
    check_plain_embedding(embedding, getattr(cls, "__name__", "embedding"))
    w = embedding.weight
    new = cls(
        embedding.num_embeddings,
        embedding.embedding_dim,
        layout,
        dtype=w.dtype,
        device=w.device,
        embed_scale=embed_scale_of(embedding),
    )
    with torch.no_grad():
        new.get_parameter("weight").copy_(spec.shard(w, rank, tp))
    return new


EMBEDDING_SPEC = GridShardSpec(i_dim=1, j_dim=1)  # hidden in q*q chunks, rank (i, j) holds chunk j*q + i


class Embedding2D(nn.Module):
    """``nn.Embedding(vocab, hidden)`` whose output is 2D: (..., hidden/q), hidden block j.

    ``weight`` (vocab, hidden/q^2) is chunk ``j*q + i`` of the serial weight's columns;
    ``embed_scale`` multiplies the lookups (a scaled embedding's, ``embedding.scaled``).
    Raises ValueError naming the numbers unless q*q divides hidden.
    """

    embed_scale: EmbedScale

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        grid: Grid2D,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        embed_scale: EmbedScale = None,
    ) -> None:
        super().__init__()
        q = grid.q
        check_grid_divisible(embedding_dim, q * q, what="embedding_dim", where="Embedding2D")
        self.num_embeddings, self.embedding_dim, self.grid = num_embeddings, embedding_dim, grid
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim // (q * q), dtype=dtype, device=device)
        )
        keep_embed_scale(self, embed_scale)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: Grid2D) -> Embedding2D:
        """The 2D twin of ``embedding`` (no padding_idx / max_norm) holding this rank's chunk."""
        return embedding_twin(cls, embedding, grid, EMBEDDING_SPEC, grid.tp_rank, grid.q * grid.q)

    def forward(self, idx: Tensor) -> Tensor:
        # (vocab, hidden/q): hidden block j
        block = all_gather_along(self.use_param(self.weight), 1, self.grid.col)
        return scaled(F.embedding(idx, block), self.embed_scale)

    def use_param(self, param: Tensor) -> Tensor:
        """``param`` as forward uses it: itself in 2D (the 2.5D subclass routes it through
        ``copy_to_region`` over the depth group, summing its gradient over the replicas)."""
        return param

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q={self.grid.q}"
