"""2.5D (Tesseract) layers: the 2D layers run inside each depth layer, weights replicated over k.

Each 2.5D layer is its 2D twin (``two_d``) over this rank's depth layer, a ``Grid2p5D`` being
that layer's ``Grid2D``: the same blocks of the same serial weights (by 2D rank ``i*q + j``,
on every depth k), the same forward and backward communication over ``tp_row`` / ``tp_col``,
on activations whose batch block is ``k*q + i`` of q*d. The one addition: each parameter
enters forward through ``copy_to_region`` over ``tp_dep`` (identity forward; backward
all-reduces its gradient over the d depth layers, each of which saw 1/d of the batch), so
the d replicas get the same, exact, full-batch gradient and stay equal under any optimizer.

Cost per rank by ``CommMeter``'s paper accounting (broadcast of S = S, all-gather = output,
reduce-scatter = input, all-reduce of S = 2S), with ``|X|`` the serial input's bytes (all
tokens of the global batch), ``|W|``, ``|b|``, ``|w|``, ``|E|`` the serial parameters' bytes
and ``T = tokens / (q*d)`` a rank's tokens; the depth terms vanish at d = 1 (2D)::

    Linear2p5D     forward   (|X|/d + |W|)/q + |b|/q
                   backward  2(|X|/d + |W|)/q + |b|/q + 2(|W| + |b|)/q^2
    LayerNorm2p5D  forward   16 T + 2|w|/q
                   backward  16 T + 2|w|/q + 4|w|/q^2
    Embedding2p5D  forward   |E|/q
                   backward  |E|/q + 2|E|/q^2
    VocabEmbedding2p5D forward |I|/d + |Y|/(d q); backward |Y|/(d q) + 2|E|/q^2

(``|I|``: the global batch's int64 ids, ``|Y|``: the serial embedding output.) The Linear is
the Tesseract cost: SUMMA's q broadcasts per depth layer of an activation block 1/d smaller
than 2D's (``|X|/(d q^2)``) and of the same weight block (``|W|/q^2``), twice that backward,
plus the weight-gradient all-reduce over depth. Exact: blocks never pad.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from tessera.comm import copy_to_region
from tessera.tensor_parallel.two_d.embedding import Embedding2D
from tessera.tensor_parallel.two_d.grid import Grid2D
from tessera.tensor_parallel.two_d.layernorm import LayerNorm2D
from tessera.tensor_parallel.two_d.linear import Linear2D
from tessera.tensor_parallel.two_d.vocab_embedding import VocabEmbedding2D
from tessera.tensor_parallel.two_p5_d.grid import Grid2p5D

__all__ = ["Embedding2p5D", "LayerNorm2p5D", "Linear2p5D", "VocabEmbedding2p5D", "depth_replica"]


def _depth(grid: Grid2D) -> Grid2p5D:
    if not isinstance(grid, Grid2p5D):
        raise ValueError(f"a 2.5d layer needs a Grid2p5D (with its depth group), got {type(grid).__name__}")
    return grid


def depth_replica(param: Tensor, grid: Grid2D) -> Tensor:
    """``param`` replicated over ``grid``'s depth: identity forward, backward all-reduces the
    gradient over ``tp_dep`` (``|param|`` all-reduced: 2|param| by the paper accounting).
    ValueError unless ``grid`` is a ``Grid2p5D``."""
    return copy_to_region(param, _depth(grid).dep)


class Linear2p5D(Linear2D):
    """``Linear2D`` (SUMMA) in this rank's depth layer, weight and bias replicated over depth
    (their gradients all-reduced over ``tp_dep``). Input (..., in/q) of batch block ``k*q+i``
    and feature block j; output (..., out/q) in the same layout. Build with
    ``Linear2p5D.from_dense(linear, grid)`` for a ``Grid2p5D``."""

    def use_param(self, param: Tensor) -> Tensor:
        return depth_replica(param, self.grid)

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid2D) -> Linear2p5D:
        """The 2.5D twin of ``linear`` holding this rank's (i, j) blocks of weight and bias."""
        _depth(grid)  # ValueError before anything is built
        return cast(Linear2p5D, super().from_dense(linear, grid))


class LayerNorm2p5D(LayerNorm2D):
    """``LayerNorm2D`` in this rank's depth layer (statistics over ``tp_row``), the affine
    replicated over depth (its gradient all-reduced over ``tp_dep``)."""

    def use_param(self, param: Tensor) -> Tensor:
        return depth_replica(param, self.grid)

    @classmethod
    def from_dense(cls, norm: nn.LayerNorm, grid: Grid2D) -> LayerNorm2p5D:
        """The 2.5D twin of ``norm`` holding this rank's chunks of its affine."""
        _depth(grid)
        return cast(LayerNorm2p5D, super().from_dense(norm, grid))


class Embedding2p5D(Embedding2D):
    """``Embedding2D`` (hidden split q*q ways, all-gathered along the column) in this rank's
    depth layer, the table chunk replicated over depth (gradient all-reduced over ``tp_dep``)."""

    def use_param(self, param: Tensor) -> Tensor:
        return depth_replica(param, self.grid)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: Grid2D) -> Embedding2p5D:
        """The 2.5D twin of ``embedding`` holding this rank's chunk of the hidden."""
        _depth(grid)
        return cast(Embedding2p5D, super().from_dense(embedding, grid))


class VocabEmbedding2p5D(VocabEmbedding2D):
    """``VocabEmbedding2D`` (vocabulary block i, hidden block j) in this rank's depth layer;
    ids of batch block ``k*q + i`` in. The table block is replicated over depth (gradient
    all-reduced over ``tp_dep``)."""

    def use_param(self, param: Tensor) -> Tensor:
        return depth_replica(param, self.grid)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, grid: Grid2D) -> VocabEmbedding2p5D:
        """The 2.5D twin of ``embedding`` holding this rank's (vocabulary, hidden) block."""
        _depth(grid)
        return cast(VocabEmbedding2p5D, super().from_dense(embedding, grid))
