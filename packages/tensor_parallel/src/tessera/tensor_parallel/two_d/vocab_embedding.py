"""2D vocabulary-split embedding (Colossal-AI's ``VocabParallelEmbedding2D``).

The serial weight (vocab, hidden) is split on both dims: rank (i, j) holds vocabulary block
i (over the rows) and hidden block j (over the columns), ``weight[vocab block i, hidden
block j]``, so no rank holds a full row of the table. Each rank is given its batch block i
of ids (the 2D layout). Forward: the ids of the q batch blocks are all-gathered along
column j (the whole batch, as ints), each rank looks up the tokens of its vocabulary block
(zero elsewhere), and the partial outputs are reduce-scattered along the column over the
batch: rank (i, j) gets batch block i, hidden block j, summed over the vocabulary blocks,
which is exact (one term is non-zero). Backward: the adjoint, an all-gather of the output
gradient along the column over the batch, then the dense gradient of the local table block.

Cost per rank, ``|Y| = batch * seq * hidden * e`` the serial output's bytes and ``|I| =
batch * seq * 8`` the int64 ids of the whole batch: forward ``|I| + |Y|/q`` (all-gather of
the ids, reduce-scatter of the partial output), backward ``|Y|/q`` (all-gather of the gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import all_gather, reduce_scatter_along
from tessera.tensor_parallel.embedding import EmbedScale, keep_embed_scale, scaled
from tessera.tensor_parallel.two_d.embedding import embedding_twin
from tessera.tensor_parallel.two_d.grid import Grid2D, GridShardSpec, check_grid_divisible

__all__ = ["VOCAB_EMBEDDING_SPEC", "VocabEmbedding2D"]

VOCAB_EMBEDDING_SPEC = GridShardSpec(i_dim=0, j_dim=1)  # vocab block i, hidden block j


class VocabEmbedding2D(nn.Module):
    """``nn.Embedding(vocab, hidden)`` with the table split on vocabulary (rows i) and hidden
    (columns j); ids (batch/q, ...) of batch block i in, (batch/q, ..., hidden/q) out.
    ``embed_scale`` multiplies the lookups (a scaled embedding's, ``embedding.scaled``).

    Raises ValueError naming the numbers unless q divides vocab and hidden.
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
        check_grid_divisible(num_embeddings, q, what="num_embeddings (vocab)", where="VocabEmbedding2D")
        check_grid_divisible(embedding_dim, q, what="embedding_dim", where="VocabEmbedding2D")
        self.num_embeddings, self.embedding_dim, self.grid = num_embeddings, embedding_dim, grid
        per = num_embeddings // q
        self.vocab_start, self.vocab_end = grid.i * per, (grid.i + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim // q, dtype=dtype, device=device))
        keep_embed_scale(self, embed_scale)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: Grid2D) -> VocabEmbedding2D:
        """The 2D twin of ``embedding`` (no padding_idx / max_norm) holding this rank's block."""
        return embedding_twin(cls, embedding, grid, VOCAB_EMBEDDING_SPEC, grid.tp_rank, grid.q * grid.q)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() == 0:
            raise ValueError("VocabEmbedding2D: expected ids with a batch dim first, got a scalar")
        ids = all_gather(idx, self.grid.col, 0)  # the whole batch, block after block
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        partial = F.embedding(local, self.use_param(self.weight)) * mine.unsqueeze(-1).to(self.weight.dtype)
        partial = scaled(partial, self.embed_scale)  # exact: one term per token is not zero
        return reduce_scatter_along(partial, 0, self.grid.col)

    def use_param(self, param: Tensor) -> Tensor:
        """``param`` as forward uses it: itself in 2D (the 2.5D subclass routes it through
        ``copy_to_region`` over the depth group, summing its gradient over the replicas)."""
        return param

    def extra_repr(self) -> str:
        vocab = f"[{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, q={self.grid.q}, vocab={vocab}"
