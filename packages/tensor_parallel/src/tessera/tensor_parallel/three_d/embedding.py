"""3D embedding, split on the hidden dimension over the whole cube (Colossal-AI's
``Embedding3D``, without replicas).

The serial weight (vocab, hidden) is cut along the hidden into q**3 chunks; rank (a, b, c)
holds chunk ``c*q*q + b*q + a`` (its tp rank). Forward all-gathers the chunks along the a
line, then along the b line, giving hidden block c of the whole vocabulary, and looks up
this rank's ids (batch block ``b*q + a``): the output (..., hidden/q) is in the stream
layout (see ``linear``). Backward: the dense gradient of that block (the sum over this
rank's tokens) is reduce-scattered back along b then a, summing over the batch: exact.

Cost per rank, ``|E| = vocab * hidden * e`` the serial weight's bytes: forward
``|E| (1/q + 1/q^2)`` (all-gather outputs), backward the same (reduce-scatter inputs). The
ids need not be batch ids: a position embedding looks up ``arange(seq)`` on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import all_gather_along
from tessera.tensor_parallel.embedding import EmbedScale, keep_embed_scale, scaled
from tessera.tensor_parallel.three_d.cube import Cube3D, CubeShardSpec, check_cube_divisible
from tessera.tensor_parallel.two_d.embedding import embedding_twin

__all__ = ["EMBEDDING_SPEC", "Embedding3D"]

EMBEDDING_SPEC = CubeShardSpec(split=("", "cba"))  # hidden in q**3 chunks, rank r holds chunk r


class Embedding3D(nn.Module):
    """``nn.Embedding(vocab, hidden)`` whose output is 3D: (..., hidden/q), hidden block c.

    ``weight`` (vocab, hidden/q^3) is chunk ``tp_rank`` of the serial weight's columns.
    ``embed_scale`` multiplies the lookups (a scaled embedding's, ``embedding.scaled``).
    Raises ValueError naming the numbers unless q^3 divides hidden.
    """

    embed_scale: EmbedScale

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        cube: Cube3D,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        embed_scale: EmbedScale = None,
    ) -> None:
        super().__init__()
        check_cube_divisible(embedding_dim, cube.q**3, what="embedding_dim", where="Embedding3D")
        self.num_embeddings, self.embedding_dim, self.cube = num_embeddings, embedding_dim, cube
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim // cube.q**3, dtype=dtype, device=device)
        )
        keep_embed_scale(self, embed_scale)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, cube: Cube3D) -> Embedding3D:
        """The 3D twin of ``embedding`` (no padding_idx / max_norm) holding this rank's chunk."""
        return embedding_twin(cls, embedding, cube, EMBEDDING_SPEC, cube.tp_rank, cube.q**3)

    def forward(self, idx: Tensor) -> Tensor:
        block = all_gather_along(all_gather_along(self.weight, 1, self.cube.input), 1, self.cube.weight)
        return scaled(F.embedding(idx, block), self.embed_scale)  # (vocab, hidden/q) block: hidden block c

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q={self.cube.q}"
