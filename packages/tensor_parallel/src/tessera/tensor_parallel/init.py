"""Seeded initialisation shared by a parallel layer and its serial twin.

A parallel layer built with ``seed=s`` holds exactly its slice of the weight that the serial
layer gets with that seed: ``torch.manual_seed(s); nn.Linear(i, o)`` (and ``nn.Embedding``)
draw their defaults from the global generator, and the functions here draw the same numbers
from a private ``torch.Generator`` seeded ``s`` (no global state is read or changed). The
full weight is drawn in fp32 on the CPU and then sliced, cast and moved, so the values do not
depend on the device, the dtype, tp or the rank (Megatron's CPU-master initialisation; it
costs one full weight of CPU memory per layer while building).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["embedding_weight", "linear_weights", "seeded_embedding", "seeded_linear"]


def linear_weights(
    in_features: int, out_features: int, *, bias: bool, seed: int
) -> tuple[Tensor, Tensor | None]:
    """The fp32 CPU ``(weight, bias)`` of ``nn.Linear(in_features, out_features)`` after
    ``torch.manual_seed(seed)``: Kaiming-uniform weight (a=sqrt(5)), then U(-1/sqrt(in), 1/sqrt(in)) bias."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
    b = None
    if bias:
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features).uniform_(-bound, bound, generator=gen)
    return weight, b


def embedding_weight(
    num_embeddings: int, embedding_dim: int, *, seed: int, padding_idx: int | None = None
) -> Tensor:
    """The fp32 CPU weight of ``nn.Embedding(num_embeddings, embedding_dim, padding_idx)`` after
    ``torch.manual_seed(seed)``: N(0, 1), the padding row zero."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.empty(num_embeddings, embedding_dim)
    nn.init.normal_(weight, generator=gen)
    if padding_idx is not None:
        weight[padding_idx].zero_()
    return weight


def seeded_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool = True,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Linear:
    """The serial twin of a parallel linear layer built with ``seed``."""
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")
    weight, b = linear_weights(in_features, out_features, bias=bias, seed=seed)
    layer.weight = nn.Parameter(weight.to(device=device, dtype=dtype))
    if b is not None:
        layer.bias = nn.Parameter(b.to(device=device, dtype=dtype))
    return layer


def seeded_embedding(
    num_embeddings: int,
    embedding_dim: int,
    *,
    seed: int = 0,
    padding_idx: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Embedding:
    """The serial twin of a vocab-parallel embedding built with ``seed``."""
    layer = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, device="meta")
    weight = embedding_weight(num_embeddings, embedding_dim, seed=seed, padding_idx=padding_idx)
    layer.weight = nn.Parameter(weight.to(device=device, dtype=dtype))
    return layer
