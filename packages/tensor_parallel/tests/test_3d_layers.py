"""Tier 1: each 3D layer's forward and backward equals the serial layer's, on threaded ranks
over a 2 x 2 x 2 cube (q=2: 8 ranks), hypothesis over shapes, batch, bias and orientation.

Each rank feeds its 3D block of a serial input (stream layout: batch block ``b*q + a`` of
q*q, hidden block c; branch layout: batch block ``b*q + c``, hidden block a) and of the
serial output gradient, and is held against the same block of the serial output and input
gradient and, for each parameter, against its shard (by the layer's ``CubeShardSpec``) of
the serial gradient.

The drivers (``tessera.tensor_parallel.testing``: ``check_linear``, ...) state the tolerance
(fp32): ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the magnitudes
of the terms behind the value. The 3D layers add the same products as the serial ones in
another order (q partial matmuls summed by a reduce-scatter, the norm's statistics as sums of
q partial sums, weight gradients reduce-scattered over the batch blocks), and a reordered sum
of n terms differs by at most about n * 2**-24 times the sum of their magnitudes (n <= 48
here: under 3e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.testing import check_classifier, check_embedding, check_layernorm, check_linear
from tessera.tensor_parallel.three_d import (
    EMBEDDING_SPEC,
    VOCAB_EMBEDDING_SPEC,
    Cube3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    VocabEmbedding3D,
    bias_spec,
    cross_entropy_3d,
    norm_spec,
    weight_spec,
)

Q = 2


@dataclass(frozen=True)
class Layout3D:
    """Rank (a, b, c) of the cube: stream layout batch block ``b*q + a`` of q*q, hidden block c;
    branch layout batch block ``b*q + c``, hidden block a; parameters by their cube spec."""

    cube: Cube3D

    def rows(self, t: Tensor, *, branch: bool = False) -> Tensor:
        cube = self.cube
        return t.chunk(cube.q**2, 0)[cube.b * cube.q + (cube.c if branch else cube.a)]

    def block(self, t: Tensor, *, branch: bool = False) -> Tensor:
        return self.rows(t, branch=branch).chunk(self.cube.q, -1)[self.cube.a if branch else self.cube.c]

    def shard(self, spec: ShardSpec, full: Tensor) -> Tensor:
        return spec.shard(full, self.cube.tp_rank, self.cube.q**3)

    def check_replicas(self, grad: Tensor) -> None:
        pass  # 3D replicates no parameter


def _layout() -> Layout3D:
    return Layout3D(Cube3D.from_mesh(Mesh(Topology(tp=Q**3, tp_mode=TPMode.THREE_D))))


@st.composite
def case(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """Sizes for a layer of ``kind``: q*q divides the batch, q the input features, q*q the
    output features and vocabulary (q**3 the sharded biases, norm affines and embedding hidden)."""
    bias = draw(st.booleans())
    split = draw(st.sampled_from([1, Q * Q]))  # embedding: the vocabulary cut q*q ways, or not
    return {
        "batch": Q * Q * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 4 if kind == "embedding" else 3)),
        "in": Q * draw(st.integers(1, 4 if kind == "linear" else 3)),
        "out": (Q**3 if bias else Q * Q) * draw(st.integers(1, 3)),
        "bias": bias,
        "swapped": draw(st.booleans()),
        "hidden": Q**3 * draw(st.integers(1, 3)),
        "shift": draw(st.sampled_from([0.0, 3.0])),  # a mean far from 0 tests the two-pass variance
        "vocab": (
            Q * Q * draw(st.integers(1, 4)) if kind == "classifier" else draw(st.integers(1, 12)) * split
        ),
        "vocab_split": split > 1,
        "ignore": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _linear(rank: int, c: dict[str, Any]) -> None:
    lay, swapped = _layout(), c["swapped"]
    check_linear(
        c,
        lay,
        lambda s: Linear3D.from_dense(s, lay.cube, swapped=swapped),
        (weight_spec(swapped), bias_spec(swapped)),
        branch=(swapped, not swapped),
    )


@settings(max_examples=25, deadline=None)
@given(c=case("linear"))
def test_linear_3d_both_orientations_equal_serial(c: dict[str, Any]) -> None:
    run_threaded(Q**3, _linear, c)


def _norm(rank: int, c: dict[str, Any]) -> None:
    lay, swapped = _layout(), c["swapped"]

    def make(serial: nn.LayerNorm) -> nn.Module:
        return LayerNorm3D.from_dense(serial, lay.cube, swapped=swapped)

    check_layernorm(c, lay, make, norm_spec(swapped), branch=swapped)


@settings(max_examples=25, deadline=None)
@given(c=case("norm"))
def test_layernorm_3d_equals_serial(c: dict[str, Any]) -> None:
    run_threaded(Q**3, _norm, c)


EMBEDDINGS = {False: (Embedding3D, EMBEDDING_SPEC), True: (VocabEmbedding3D, VOCAB_EMBEDDING_SPEC)}


def _embedding(rank: int, c: dict[str, Any]) -> None:
    lay = _layout()
    cls, spec = EMBEDDINGS[c["vocab_split"]]
    check_embedding(c, lay, lambda s: cls.from_dense(s, lay.cube), spec)


@settings(max_examples=20, deadline=None)
@given(c=case("embedding"))
def test_embedding_3d_hidden_and_vocab_split_equal_serial(c: dict[str, Any]) -> None:
    run_threaded(Q**3, _embedding, c)


def _classifier(rank: int, c: dict[str, Any]) -> float:
    lay = _layout()
    loss = partial(cross_entropy_3d, cube=lay.cube)
    return check_classifier(c, lay, lambda s: Linear3D.from_dense(s, lay.cube), weight_spec(False), loss)


@settings(max_examples=20, deadline=None)
@given(c=case("classifier"))
def test_classifier_and_cross_entropy_3d_equal_serial(c: dict[str, Any]) -> None:
    losses = run_threaded(Q**3, _classifier, c)
    assert len(set(losses)) == 1  # the same loss on every rank


def _bad_linear(rank: int) -> None:
    Linear3D(5, 8, _layout().cube, bias=True)


def test_a_linear_the_cube_cannot_split_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"Linear3D: in_features=5 is not divisible by 2"):
        run_threaded(Q**3, _bad_linear)
