"""A token embedding whose vocabulary rows are split across the tensor-parallel group.

A *scaled* embedding (Hugging Face Gemma's ``GemmaTextScaledWordEmbedding``: its forward
returns the lookup times ``embed_scale``, sqrt(hidden)) keeps its scale: ``embed_scale_of``
reads it, every embedding that replaces one (this module's, and the 2D/2.5D/3D ones) carries
it and multiplies its lookups by it as the serial module does (``scaled``), so the result is the
serial one bit for bit. ``vocab_share`` is one rank's lookup, pure: the layer's forward and the
probe (``probe_modules``) compute it alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Group, group_rank, group_size
from tessera.tensor_parallel.init import embedding_weight
from tessera.tensor_parallel.partition import shard_range
from tessera.tensor_parallel.sequence import exit_tp_region

__all__ = [
    "EmbedScale",
    "VocabParallelEmbedding",
    "embed_scale_of",
    "keep_embed_scale",
    "scaled",
    "vocab_share",
]

EmbedScale = Tensor | float | None
"""What a scaled embedding multiplies its lookups by: a one-element tensor (HF's buffer), a
number, or None (a plain embedding)."""


def embed_scale_of(module: nn.Module) -> EmbedScale:
    """The scale ``module`` multiplies its lookups by: its ``embed_scale`` attribute when that is
    a one-element tensor or a number (HF Gemma, Gemma2, Gemma3), else None. A scale kept under
    another name is not seen here: the probe (``probe_modules``) refuses such a module."""
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, Tensor) and scale.numel() == 1:
        return scale
    if isinstance(scale, int | float) and not isinstance(scale, bool):
        return float(scale)
    return None


def keep_embed_scale(layer: nn.Module, scale: EmbedScale) -> None:
    """Give ``layer`` the attribute ``embed_scale``: a tensor as a copy in a non-persistent buffer
    (as HF keeps it: it follows ``.to()`` and stays out of the state dict), else the number or None."""
    if isinstance(scale, Tensor):
        layer.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
    else:
        setattr(layer, "embed_scale", scale)  # noqa: B010 - a number, not a Module or Tensor


def scaled(out: Tensor, scale: EmbedScale) -> Tensor:
    """``out`` times ``scale`` as HF does it (``out * embed_scale.to(out.dtype)``; a number as a
    Python scalar); ``out`` itself for None."""
    if scale is None:
        return out
    return out * (scale.to(out.dtype) if isinstance(scale, Tensor) else scale)


def vocab_share(
    idx: Tensor, weight: Tensor, start: int, *, padding_idx: int | None = None, scale: EmbedScale = None
) -> Tensor:
    """One rank's share of a vocabulary-split lookup, pure: ``weight`` holds rows
    ``[start, start + len(weight))`` of the table; tokens outside them get zeros; the result is
    ``scaled`` by ``scale``. Summed over the ranks it is the serial (scaled) lookup, exactly (one
    term per token is not zero). ``padding_idx`` (the serial one) only stops its row's gradient."""
    rows = int(weight.shape[0])
    local = idx - start
    outside = (local < 0) | (local >= rows)
    local = local.masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows else None
    out = F.embedding(local, weight, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)
    return scaled(out, scale)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with rows ``[v0, v1)`` of the vocabulary on this rank.

    Each rank looks up the tokens in its range (zeros for the others), then the partial
    embeddings are summed over the group: an all-reduce of the output (2x it), or with
    ``sequence_parallel`` a reduce-scatter along ``seq_dim`` (the output then holds this
    rank's slice of the sequence). Backward: nothing, or an all-gather of the gradient.
    ``seed`` initialises the slice of ``torch.manual_seed(seed); nn.Embedding(V, d)``.
    ``embed_scale`` (a scaled embedding's, ``embed_scale_of``) multiplies the lookups as the
    serial module does (``scaled``): a tensor is kept in a non-persistent buffer.
    """

    embed_scale: EmbedScale

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
        embed_scale: EmbedScale = None,
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
        keep_embed_scale(self, embed_scale)
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
        """This rank's rows of an ``nn.Embedding`` (plain lookups only: no max_norm, no sparse),
        with its scale (``scale_of``) if it is a scaled embedding."""
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
            embed_scale=cls.scale_of(module),
        )
        layer.load_full(module.weight)
        return layer

    @staticmethod
    def scale_of(module: nn.Module) -> EmbedScale:
        """The scale ``from_embedding`` carries over from ``module`` (``embed_scale_of``); the
        probe (``probe_modules``) asks the same of every embedding a style splits."""
        return embed_scale_of(module)

    def forward(self, idx: Tensor) -> Tensor:
        out = vocab_share(
            idx, self.weight, self.vocab_start, padding_idx=self.padding_idx, scale=self.embed_scale
        )
        return exit_tp_region(  # out is a temporary (masked_fill saves only its mask; a scale, itself)
            out, self.group, sequence_parallel=self.sequence_parallel, seq_dim=self.seq_dim, private=True
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) here, "
            f"tp={self.tp}, sequence_parallel={self.sequence_parallel}"
            + ("" if self.embed_scale is None else f", embed_scale={float(self.embed_scale):.6g}")
        )
