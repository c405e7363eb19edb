"""A token embedding whose vocabulary rows are split across the tensor-parallel group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Group, group_rank, group_size
from tessera.tensor_parallel.init import embedding_weight
from tessera.tensor_parallel.partition import shard_range
from tessera.tensor_parallel.sequence import exit_tp_region

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with rows ``[v0, v1)`` of the vocabulary on this rank.

    Each rank looks up the tokens in its range (zeros for the others), then the partial
    embeddings are summed over the group: an all-reduce of the output (2x it), or with
    ``sequence_parallel`` a reduce-scatter along ``seq_dim`` (the output then holds this
    rank's slice of the sequence). Backward: nothing, or an all-gather of the gradient.
    ``seed`` initialises the slice of ``torch.manual_seed(seed); nn.Embedding(V, d)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = -2,
        seed: int | None = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        n = group_size(group)
        self.vocab_start, self.vocab_end = shard_range(
            num_embeddings, n, group_rank(group), what="num_embeddings (vocab)", where=type(self).__name__
        )
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} is outside [0, {num_embeddings})")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.group, self.tp = group, n
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        local = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype, device=device))
        if seed is not None:
            self.load_full(
                embedding_weight(num_embeddings, embedding_dim, seed=seed, padding_idx=padding_idx)
            )

    def shard_of(self, name: str, full: Tensor) -> Tensor:
        """This rank's rows of the serial embedding's (V, d) ``weight``."""
        expect = (self.num_embeddings, self.embedding_dim)
        if name != "weight" or tuple(full.shape) != expect:
            raise ValueError(
                f"VocabParallelEmbedding.shard_of({name!r}): shape {tuple(full.shape)} != {expect}"
            )
        return full[self.vocab_start : self.vocab_end]

    @torch.no_grad()
    def load_full(self, weight: Tensor) -> None:
        """Copy this rank's rows of a full (V, d) weight into the layer."""
        self.weight.copy_(self.shard_of("weight", weight))

    @classmethod
    def from_embedding(
        cls, module: nn.Embedding, *, group: Group, sequence_parallel: bool = False, seq_dim: int = -2
    ) -> VocabParallelEmbedding:
        """This rank's rows of an ``nn.Embedding`` (plain lookups only: no max_norm, no sparse)."""
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(
                f"VocabParallelEmbedding supports plain lookups only; got max_norm={module.max_norm}, "
                f"sparse={module.sparse}, scale_grad_by_freq={module.scale_grad_by_freq}"
            )
        layer = cls(
            module.num_embeddings,
            module.embedding_dim,
            group=group,
            padding_idx=module.padding_idx,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            seed=None,
            dtype=module.weight.dtype,
            device=module.weight.device,
        )
        layer.load_full(module.weight)
        return layer

    def forward(self, idx: Tensor) -> Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        local = local.masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = (
            pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        )
        out = F.embedding(local, self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(  # out is a temporary (masked_fill saves only its mask)
            out, self.group, sequence_parallel=self.sequence_parallel, seq_dim=self.seq_dim, private=True
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) here, "
            f"tp={self.tp}, sequence_parallel={self.sequence_parallel}"
        )
