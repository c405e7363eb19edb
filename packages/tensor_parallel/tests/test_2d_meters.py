"""Tier 1: the bytes each 2D layer moves per forward and per backward, by ``CommMeter``'s
paper accounting (broadcast of S = S, all-gather = its output, reduce-scatter = its input,
all-reduce of S = 2S), equal the cost formulas in the layers' docstrings, exactly: blocks
never pad. ``|X|``, ``|W|``, ``|b|``, ``|E|`` are the serial tensors' bytes, q the grid side,
T a rank's tokens.

- Linear2D (SUMMA): forward (|X| + |W|)/q + |b|/q; backward 2(|X| + |W|)/q + |b|/q.
- LayerNorm2D: forward 16 T + 2|w|/q; backward 16 T + 2|w|/q.
- Embedding2D: forward |E|/q; backward |E|/q.
- VocabEmbedding2D: forward |I| + |Y|/q (all-gathered int64 ids, output); backward |Y|/q.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import CommOp, Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.testing import metered_layer
from tessera.tensor_parallel.two_d import Embedding2D, Grid2D, LayerNorm2D, Linear2D, VocabEmbedding2D

E = 4  # fp32 bytes


@st.composite
def case(draw: st.DrawFn) -> dict[str, Any]:
    q = draw(st.sampled_from([2, 2, 3]))
    return {
        "q": q,
        "batch": q * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 3)),
        "in": q * q * draw(st.integers(1, 3)),
        "out": q * q * draw(st.integers(1, 3)),
        "bias": draw(st.booleans()),
    }


def _meter(rank: int, c: dict[str, Any], kind: str) -> tuple[int, int, dict[CommOp, int], dict[CommOp, int]]:
    q = c["q"]
    grid = Grid2D.from_mesh(Mesh(Topology(tp=q * q, tp_mode=TPMode.TWO_D)))
    layers: dict[str, Any] = {
        "linear": Linear2D,
        "norm": LayerNorm2D,
        "embedding": Embedding2D,
        "vocab": VocabEmbedding2D,
    }
    return metered_layer(kind, c, rows=c["batch"] // q, q=q, make=lambda k, s: layers[k].from_dense(s, grid))


@settings(max_examples=20)
@given(c=case())
def test_linear_2d_moves_the_summa_cost(c: dict[str, Any]) -> None:
    q = c["q"]
    x, w = c["batch"] * c["seq"] * c["in"] * E, c["in"] * c["out"] * E
    b = c["out"] * E if c["bias"] else 0
    for fwd, bwd, _, ops in run_threaded(q * q, _meter, c, "linear"):
        assert fwd == (x + w) // q + b // q
        assert bwd == 2 * (x + w) // q + b // q
        assert ops[CommOp.BROADCAST] == (x + w) // q  # the re-broadcasts; the rest are the reduces
        assert ops[CommOp.REDUCE_SCATTER] == (x + w) // q + b // q


@settings(max_examples=10)
@given(c=case())
def test_layernorm_2d_and_the_embeddings_move_their_formulas(c: dict[str, Any]) -> None:
    q = c["q"]
    tokens = c["batch"] // q * c["seq"]
    w = c["in"] * E
    for fwd, bwd, _, _ in run_threaded(q * q, _meter, c, "norm"):
        assert (fwd, bwd) == (16 * tokens + 2 * w // q, 16 * tokens + 2 * w // q)
    table = c["out"] * c["in"] * E
    for fwd, bwd, _, _ in run_threaded(q * q, _meter, c, "embedding"):
        assert (fwd, bwd) == (table // q, table // q)
    ids, out = c["batch"] * c["seq"] * 8, c["batch"] * c["seq"] * c["in"] * E
    for fwd, bwd, _, _ in run_threaded(q * q, _meter, c, "vocab"):
        assert (fwd, bwd) == (ids + out // q, out // q)
