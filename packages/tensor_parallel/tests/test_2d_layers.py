"""Tier 1: each 2D layer's forward and backward equals the serial layer's, on threaded ranks
over a q x q grid (q=2: 4 ranks, q=3: 9 ranks), hypothesis over shapes, batch and bias.

Each rank feeds its 2D block of a serial input (batch block i, feature block j) and of the
serial output gradient, and is held against the same block of the serial output and input
gradient and, for each parameter, against its shard (by the layer's ``GridShardSpec``) of the
serial gradient.

The drivers (``tessera.tensor_parallel.testing``: ``check_linear``, ...) state the tolerance
(fp32): ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the magnitudes
of the terms behind the value. The 2D layers add the same products as the serial ones in
another order (SUMMA sums q partial matmuls, the norm's statistics are sums of q partial
sums, the weight gradients are reduce-scattered sums of per-row partials), and a reordered
sum of n terms differs by at most about n * 2**-24 times the sum of their magnitudes (n <= 48
here: under 3e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.testing import check_classifier, check_embedding, check_layernorm, check_linear
from tessera.tensor_parallel.two_d import (
    BIAS_SPEC,
    EMBEDDING_SPEC,
    NORM_SPEC,
    VOCAB_EMBEDDING_SPEC,
    WEIGHT_SPEC,
    Embedding2D,
    Grid2D,
    LayerNorm2D,
    Linear2D,
    VocabEmbedding2D,
    cross_entropy_2d,
)

qs = st.sampled_from([2, 2, 3])  # q=3 (9 threads) a third of the time


@dataclass(frozen=True)
class Layout2D:
    """Rank (i, j) of the grid: batch block i, hidden block j; parameters by their spec."""

    grid: Grid2D

    def rows(self, t: Tensor, *, branch: bool = False) -> Tensor:
        return t.chunk(self.grid.q, 0)[self.grid.i]

    def block(self, t: Tensor, *, branch: bool = False) -> Tensor:
        return self.rows(t).chunk(self.grid.q, -1)[self.grid.j]

    def shard(self, spec: ShardSpec, full: Tensor) -> Tensor:
        return spec.shard(full, self.grid.tp_rank, self.grid.q**2)

    def check_replicas(self, grad: Tensor) -> None:
        pass  # 2D replicates no parameter


def _layout(c: dict[str, Any]) -> Layout2D:
    return Layout2D(Grid2D.from_mesh(Mesh(Topology(tp=c["q"] ** 2, tp_mode=TPMode.TWO_D))))


@st.composite
def case(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """Sizes for a layer of ``kind``: q divides the batch and the features (q*q the sharded
    biases, norm affines and embedding hidden), a vocabulary split over q when asked."""
    q = draw(qs)
    bias = draw(st.booleans())
    split = draw(st.sampled_from([1, q]))  # embedding: the vocabulary split over q, or not
    return {
        "q": q,
        "batch": q * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 4 if kind == "embedding" else 3)),
        "in": q * draw(st.integers(1, 4 if kind == "linear" else 3)),
        "out": (q * q if bias else q) * draw(st.integers(1, 3)),
        "bias": bias,
        "hidden": q * q * draw(st.integers(1, 3)),
        "shift": draw(st.sampled_from([0.0, 3.0])),  # a mean far from 0 tests the two-pass variance
        "vocab": q * draw(st.integers(1, 5)) if kind == "classifier" else draw(st.integers(1, 12)) * split,
        "vocab_split": split > 1,
        "ignore": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _linear(rank: int, c: dict[str, Any]) -> None:
    lay = _layout(c)
    check_linear(c, lay, lambda s: Linear2D.from_dense(s, lay.grid), (WEIGHT_SPEC, BIAS_SPEC))


@settings(max_examples=30)
@given(c=case("linear"))
def test_linear_2d_equals_serial(c: dict[str, Any]) -> None:
    run_threaded(c["q"] ** 2, _linear, c)


def _norm(rank: int, c: dict[str, Any]) -> None:
    lay = _layout(c)
    check_layernorm(c, lay, lambda s: LayerNorm2D.from_dense(s, lay.grid), NORM_SPEC)


@settings(max_examples=30)
@given(c=case("norm"))
def test_layernorm_2d_equals_serial(c: dict[str, Any]) -> None:
    run_threaded(c["q"] ** 2, _norm, c)


EMBEDDINGS = {False: (Embedding2D, EMBEDDING_SPEC), True: (VocabEmbedding2D, VOCAB_EMBEDDING_SPEC)}


def _embedding(rank: int, c: dict[str, Any]) -> None:
    lay = _layout(c)
    cls, spec = EMBEDDINGS[c["vocab_split"]]
    check_embedding(c, lay, lambda s: cls.from_dense(s, lay.grid), spec)


@settings(max_examples=30)
@given(c=case("embedding"))
def test_embedding_2d_hidden_and_vocab_split_equal_serial(c: dict[str, Any]) -> None:
    run_threaded(c["q"] ** 2, _embedding, c)


def _classifier(rank: int, c: dict[str, Any]) -> float:
    lay = _layout(c)
    loss = partial(cross_entropy_2d, grid=lay.grid)
    return check_classifier(c, lay, lambda s: Linear2D.from_dense(s, lay.grid), WEIGHT_SPEC, loss)


@settings(max_examples=30)
@given(c=case("classifier"))
def test_classifier_and_cross_entropy_2d_equal_serial(c: dict[str, Any]) -> None:
    losses = run_threaded(c["q"] ** 2, _classifier, c)
    assert len(set(losses)) == 1  # the same loss on every rank
