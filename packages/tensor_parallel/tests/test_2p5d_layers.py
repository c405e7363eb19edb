"""Tier 1: each 2.5D layer's forward and backward equals the serial layer's, on threaded ranks
over a q x q x d grid (q=2 or 3, d=2: 8 or 18 ranks; d=1 a quarter of the time, the 2D case),
hypothesis over q, d, shapes, batch and bias.

Each rank feeds its 2.5D block of a serial input (batch block ``k*q + i`` of q*d, feature
block j) and of the serial output gradient, and is held against the same block of the serial
output and input gradient and, for each parameter, against its shard (by the layer's
``DepthShardSpec``) of the serial gradient; the d depth replicas of a parameter must also
get bitwise-equal gradients (one all-reduce gives every rank the same sum).

The drivers (``tessera.tensor_parallel.testing``: ``check_linear``, ...) state the tolerance
(fp32): ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the magnitudes
of the terms behind the value, as in the 2D tests. The 2.5D layers add the same products as
the serial ones in another order (SUMMA's q partial matmuls, the per-row partial statistics,
the weight gradients summed over the column and then over the depth), and a reordered sum
of n terms differs by at most about n * 2**-24 times the sum of their magnitudes (n <= 48
here: under 3e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import Mesh, Topology, TPMode, all_gather
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.testing import check_classifier, check_embedding, check_layernorm, check_linear
from tessera.tensor_parallel.two_d import (
    BIAS_SPEC,
    EMBEDDING_SPEC,
    NORM_SPEC,
    VOCAB_EMBEDDING_SPEC,
    WEIGHT_SPEC,
    GridShardSpec,
)
from tessera.tensor_parallel.two_p5_d import (
    DepthShardSpec,
    Embedding2p5D,
    Grid2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
    cross_entropy_2p5d,
)

qs = st.sampled_from([2, 2, 3])  # q=3 a third of the time: 9 ranks, or 18 at depth 2
depths = st.sampled_from([2, 2, 2, 1])


@dataclass(frozen=True)
class Layout2p5D:
    """Rank (k, i, j): batch block ``k*q + i`` of q*d, hidden block j; parameters by the 2D
    spec replicated over the depth (``DepthShardSpec``), the d replicas' gradients bitwise equal
    (one all-reduce gives every rank the same sum)."""

    grid: Grid2p5D

    def rows(self, t: Tensor, *, branch: bool = False) -> Tensor:
        return t.chunk(self.grid.q * self.grid.d, 0)[self.grid.batch_index]

    def block(self, t: Tensor, *, branch: bool = False) -> Tensor:
        return self.rows(t).chunk(self.grid.q, -1)[self.grid.j]

    def shard(self, spec: ShardSpec, full: Tensor) -> Tensor:
        assert isinstance(spec, GridShardSpec)
        g = self.grid
        depth_spec = DepthShardSpec(i_dim=spec.i_dim, j_dim=spec.j_dim, depth=g.d)
        return depth_spec.shard(full, g.tesseract_rank, g.q * g.q * g.d)

    def check_replicas(self, grad: Tensor) -> None:
        for other in all_gather(grad.unsqueeze(0), self.grid.dep, 0):
            assert torch.equal(other, grad)


def _layout(c: dict[str, Any]) -> Layout2p5D:
    q, d = c["q"], c["d"]
    return Layout2p5D(Grid2p5D.from_mesh(Mesh(Topology(tp=q * q * d, tp_mode=TPMode.TWO_P5_D, tp_depth=d))))


def _run(c: dict[str, Any], fn: Any) -> list[Any]:
    return run_threaded(c["q"] ** 2 * c["d"], fn, c)


@st.composite
def case(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """Sizes for a layer of ``kind``: q*d divides the batch, q the features (q*q the sharded
    biases, norm affines and embedding hidden), a vocabulary split over q when asked."""
    q, d = draw(qs), draw(depths)
    bias = draw(st.booleans())
    split = draw(st.sampled_from([1, q]))  # embedding: the vocabulary split over q, or not
    return {
        "q": q,
        "d": d,
        "batch": q * d * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 4 if kind == "embedding" else 3)),
        "in": q * draw(st.integers(1, 4 if kind == "linear" else 3)),
        "out": (q * q if bias else q) * draw(st.integers(1, 3)),
        "bias": bias,
        "hidden": q * q * draw(st.integers(1, 3)),
        "shift": draw(st.sampled_from([0.0, 3.0])),  # a mean far from 0 tests the two-pass variance
        "vocab": q * draw(st.integers(1, 5)) if kind == "classifier" else draw(st.integers(1, 12)) * split,
        "vocab_split": split > 1,
        "ignore": draw(st.booleans()),  # the ignored token is on depth 0
        "seed": draw(st.integers(0, 2**16)),
    }


def _linear(rank: int, c: dict[str, Any]) -> None:
    lay = _layout(c)
    check_linear(c, lay, lambda s: Linear2p5D.from_dense(s, lay.grid), (WEIGHT_SPEC, BIAS_SPEC))


@settings(max_examples=15, deadline=None)
@given(c=case("linear"))
def test_linear_2p5d_equals_serial(c: dict[str, Any]) -> None:
    _run(c, _linear)


def _norm(rank: int, c: dict[str, Any]) -> None:
    lay = _layout(c)
    check_layernorm(c, lay, lambda s: LayerNorm2p5D.from_dense(s, lay.grid), NORM_SPEC)


@settings(max_examples=15, deadline=None)
@given(c=case("norm"))
def test_layernorm_2p5d_equals_serial(c: dict[str, Any]) -> None:
    _run(c, _norm)


EMBEDDINGS = {False: (Embedding2p5D, EMBEDDING_SPEC), True: (VocabEmbedding2p5D, VOCAB_EMBEDDING_SPEC)}


def _embedding(rank: int, c: dict[str, Any]) -> None:
    lay = _layout(c)
    cls, spec = EMBEDDINGS[c["vocab_split"]]
    check_embedding(c, lay, lambda s: cls.from_dense(s, lay.grid), spec)


@settings(max_examples=15, deadline=None)
@given(c=case("embedding"))
def test_embedding_2p5d_hidden_and_vocab_split_equal_serial(c: dict[str, Any]) -> None:
    _run(c, _embedding)


def _classifier(rank: int, c: dict[str, Any]) -> float:
    lay = _layout(c)
    loss = partial(cross_entropy_2p5d, grid=lay.grid)
    return check_classifier(c, lay, lambda s: Linear2p5D.from_dense(s, lay.grid), WEIGHT_SPEC, loss)


@settings(max_examples=15, deadline=None)
@given(c=case("classifier"))
def test_classifier_and_cross_entropy_2p5d_equal_serial(c: dict[str, Any]) -> None:
    losses = _run(c, _classifier)
    assert len(set(losses)) == 1  # the same loss on every rank
