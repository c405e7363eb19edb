"""3D vocabulary-split embedding (Colossal-AI's ``VocabParallelEmbedding3D``, without replicas).

The serial weight (vocab, hidden) is cut on both dims: rank (a, b, c) holds vocabulary chunk
``a*q + b`` of q*q and hidden block c (``VOCAB_EMBEDDING_SPEC``, the layout of a
``3d_linear`` weight), so no rank holds a full row of the table. Each rank is given its batch
block ``b*q + a`` of ids (the stream layout). Forward: the ids are all-gathered along the a
line, then along the b line (the whole batch, as ints); each rank looks up the tokens of its
vocabulary chunk (zero elsewhere); the partial outputs are reduce-scattered over the batch
along the b line, then along the a line: rank (a, b, c) gets batch block ``b*q + a``, hidden
block c, summed over the q*q vocabulary chunks, which is exact (one term is non-zero).
Backward: the adjoint, all-gathers of the output gradient along a then b, then the dense
gradient of the local table block.

Cost per rank, ``|Y| = batch * seq * hidden * e`` the serial output's bytes and ``|I| =
batch * seq * 8`` the int64 ids of the whole batch: forward ``|I| (1 + 1/q)`` (all-gathers of
the ids) ``+ |Y| (1/q + 1/q^2)`` (reduce-scatters), backward ``|Y| (1/q + 1/q^2)`` (all-gathers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import all_gather, reduce_scatter_along
from tessera.tensor_parallel.embedding import EmbedScale, keep_embed_scale, scaled
from tessera.tensor_parallel.three_d.cube import Cube3D, CubeShardSpec, check_cube_divisible
from tessera.tensor_parallel.two_d.embedding import embedding_twin

__all__ = ["VOCAB_EMBEDDING_SPEC", "VocabEmbedding3D"]

VOCAB_EMBEDDING_SPEC = CubeShardSpec(split=("ab", "c"))  # vocab chunk a*q + b, hidden block c


class VocabEmbedding3D(nn.Module):
    """``nn.Embedding(vocab, hidden)`` with the table cut on the vocabulary (chunk ``a*q + b``)
    and the hidden (block c); ids (batch/q^2, ...) of batch block ``b*q + a`` in,
    (batch/q^2, ..., hidden/q) out. ``embed_scale`` multiplies the lookups (a scaled
    embedding's, ``embedding.scaled``). ValueError naming the numbers unless q*q divides vocab
    and q divides hidden.
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
        q = cube.q
        where = "VocabEmbedding3D"
        check_cube_divisible(num_embeddings, q * q, what="num_embeddings (vocab)", where=where)
        check_cube_divisible(embedding_dim, q, what="embedding_dim", where=where)
        self.num_embeddings, self.embedding_dim, self.cube = num_embeddings, embedding_dim, cube
        per = num_embeddings // (q * q)
        self.vocab_start = (cube.a * q + cube.b) * per
        self.vocab_end = self.vocab_start + per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim // q, dtype=dtype, device=device))
        keep_embed_scale(self, embed_scale)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, cube: Cube3D) -> VocabEmbedding3D:
        """The 3D twin of ``embedding`` (no padding_idx / max_norm) holding this rank's block."""
        return embedding_twin(cls, embedding, cube, VOCAB_EMBEDDING_SPEC, cube.tp_rank, cube.q**3)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() == 0:
            raise ValueError("VocabEmbedding3D: expected ids with a batch dim first, got a scalar")
        ids = all_gather(all_gather(idx.contiguous(), self.cube.input, 0), self.cube.weight, 0)  # whole batch
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        partial = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        partial = scaled(partial, self.embed_scale)  # exact: one term per token is not zero
        return reduce_scatter_along(reduce_scatter_along(partial, 0, self.cube.weight), 0, self.cube.input)

    def extra_repr(self) -> str:
        vocab = f"[{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, q={self.cube.q}, vocab={vocab}"
