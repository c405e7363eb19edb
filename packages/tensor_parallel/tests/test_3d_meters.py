"""Tier 1: the bytes each 3D layer moves per forward and per backward, by ``CommMeter``'s
paper accounting (all-gather = its output, reduce-scatter = its input, all-reduce of S = 2S),
equal the cost formulas in the layers' docstrings, exactly: blocks never pad. ``|X|``,
``|W|``, ``|Y|``, ``|b|``, ``|w|``, ``|E|`` are the serial tensors' bytes, q the cube side
(2: 8 threaded ranks), T a rank's tokens.

- Linear3D (either orientation): forward and backward each (|X| + |W| + |Y|)/q^2 + |b|(1/q + 1/q^2).
- LayerNorm3D: forward and backward each 16 T + 2|w|(1/q + 1/q^2).
- Embedding3D: forward and backward each |E|(1/q + 1/q^2).
- VocabEmbedding3D: forward |I|(1 + 1/q) (int64 ids all-gathered) + |Y|(1/q + 1/q^2); backward
  |Y|(1/q + 1/q^2).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import CommOp, Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.testing import metered_layer
from tessera.tensor_parallel.three_d import Cube3D, Embedding3D, LayerNorm3D, Linear3D, VocabEmbedding3D

E, Q = 4, 2  # fp32 bytes, cube side


@st.composite
def case(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "batch": Q * Q * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "in": Q**3 * draw(st.integers(1, 3)),
        "out": Q**3 * draw(st.integers(1, 3)),
        "bias": draw(st.booleans()),
        "swapped": draw(st.booleans()),
    }


def _meter(rank: int, c: dict[str, Any], kind: str) -> tuple[int, int, dict[CommOp, int], dict[CommOp, int]]:
    cube = Cube3D.from_mesh(Mesh(Topology(tp=Q**3, tp_mode=TPMode.THREE_D)))
    oriented = {"swapped": c["swapped"]}
    makers: dict[str, Any] = {
        "linear": lambda s: Linear3D.from_dense(s, cube, **oriented),
        "norm": lambda s: LayerNorm3D.from_dense(s, cube, **oriented),
        "embedding": lambda s: Embedding3D.from_dense(s, cube),
        "vocab": lambda s: VocabEmbedding3D.from_dense(s, cube),
    }
    return metered_layer(kind, c, rows=c["batch"] // (Q * Q), q=Q, make=lambda k, s: makers[k](s))


@settings(max_examples=15, deadline=None)
@given(c=case())
def test_linear_3d_moves_the_3d_matmul_cost(c: dict[str, Any]) -> None:
    x, w, y = (
        c["batch"] * c["seq"] * c["in"] * E,
        c["in"] * c["out"] * E,
        c["batch"] * c["seq"] * c["out"] * E,
    )
    b = c["out"] * E if c["bias"] else 0
    for fwd, bwd, fops, bops in run_threaded(Q**3, _meter, c, "linear"):
        assert fwd == (x + w + y) // Q**2 + b // Q + b // Q**2
        assert bwd == (x + w + y) // Q**2 + b // Q + b // Q**2
        assert fops[CommOp.ALL_GATHER] == (x + w) // Q**2 + b // Q + b // Q**2  # X, W (and bias)
        assert fops[CommOp.REDUCE_SCATTER] == y // Q**2  # the partial products
        assert bops[CommOp.ALL_GATHER] == y // Q**2  # dY
        assert bops[CommOp.REDUCE_SCATTER] == (x + w) // Q**2 + b // Q + b // Q**2  # dX, dW (and db)


@settings(max_examples=8, deadline=None)
@given(c=case())
def test_layernorm_3d_and_the_embeddings_move_their_formulas(c: dict[str, Any]) -> None:
    tokens = c["batch"] // (Q * Q) * c["seq"]
    w = c["in"] * E
    for fwd, bwd, _, _ in run_threaded(Q**3, _meter, c, "norm"):
        assert (fwd, bwd) == (16 * tokens + 2 * (w // Q + w // Q**2),) * 2
    table = c["out"] * c["in"] * E
    for fwd, bwd, _, _ in run_threaded(Q**3, _meter, c, "embedding"):
        assert (fwd, bwd) == (table // Q + table // Q**2,) * 2
    ids, out = c["batch"] * c["seq"] * 8, c["batch"] * c["seq"] * c["in"] * E
    for fwd, bwd, _, _ in run_threaded(Q**3, _meter, c, "vocab"):
        assert (fwd, bwd) == (ids + ids // Q + out // Q + out // Q**2, out // Q + out // Q**2)
