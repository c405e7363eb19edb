"""Tier 1: the bytes each 2.5D layer moves per forward and per backward, by ``CommMeter``'s
paper accounting (broadcast of S = S, all-gather = its output, reduce-scatter = its input,
all-reduce of S = 2S), equal the Tesseract cost formulas of ``two_p5_d.layers``, exactly:
blocks never pad. ``|X|``, ``|W|``, ``|b|``, ``|w|``, ``|E|`` are the serial tensors' bytes
(``|X|`` over the global batch), q the side, d the depth, T = tokens / (q d) a rank's tokens;
every depth term is the all-reduce of a replicated parameter's gradient over ``tp_dep``
(zero at d = 1, where the formulas are 2D's).

- Linear2p5D: forward (|X|/d + |W|)/q + |b|/q; backward 2(|X|/d + |W|)/q + |b|/q + 2(|W| + |b|)/q^2.
- LayerNorm2p5D: forward 16 T + 2|w|/q; backward 16 T + 2|w|/q + 4|w|/q^2.
- Embedding2p5D: forward |E|/q; backward |E|/q + 2|E|/q^2.
- VocabEmbedding2p5D: forward |I|/d + |Y|/(d q); backward |Y|/(d q) + 2|E|/q^2.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import CommOp, Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.testing import metered_layer
from tessera.tensor_parallel.two_p5_d import (
    Embedding2p5D,
    Grid2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
)

E = 4  # fp32 bytes


@st.composite
def case(draw: st.DrawFn) -> dict[str, Any]:
    q, d = draw(st.sampled_from([2, 2, 3])), draw(st.sampled_from([2, 2, 1]))
    return {
        "q": q,
        "d": d,
        "batch": q * d * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 3)),
        "in": q * q * draw(st.integers(1, 3)),
        "out": q * q * draw(st.integers(1, 3)),
        "bias": draw(st.booleans()),
    }


def _meter(rank: int, c: dict[str, Any], kind: str) -> tuple[int, int, dict[CommOp, int], dict[CommOp, int]]:
    q, d = c["q"], c["d"]
    grid = Grid2p5D.from_mesh(Mesh(Topology(tp=q * q * d, tp_mode=TPMode.TWO_P5_D, tp_depth=d)))
    layers: dict[str, Any] = {
        "linear": Linear2p5D,
        "norm": LayerNorm2p5D,
        "embedding": Embedding2p5D,
        "vocab": VocabEmbedding2p5D,
    }
    rows = c["batch"] // (q * d)
    return metered_layer(kind, c, rows=rows, q=q, make=lambda k, s: layers[k].from_dense(s, grid))


@settings(max_examples=15, deadline=None)
@given(c=case())
def test_linear_2p5d_moves_the_tesseract_cost(c: dict[str, Any]) -> None:
    q, d = c["q"], c["d"]
    x, w = c["batch"] * c["seq"] * c["in"] * E, c["in"] * c["out"] * E
    b = c["out"] * E if c["bias"] else 0
    depth = 2 * (w + b) // q**2 if d > 1 else 0
    for fwd, bwd, _, ops in run_threaded(q * q * d, _meter, c, "linear"):
        assert fwd == (x // d + w) // q + b // q
        assert bwd == 2 * (x // d + w) // q + b // q + depth
        assert ops[CommOp.BROADCAST] == (x // d + w) // q  # the re-broadcasts
        assert ops[CommOp.REDUCE_SCATTER] == (x // d + w) // q + b // q  # the SUMMA reduces
        assert ops.get(CommOp.ALL_REDUCE, 0) == depth  # weight gradients summed over depth


@settings(max_examples=10, deadline=None)
@given(c=case())
def test_layernorm_and_the_embeddings_2p5d_move_their_formulas(c: dict[str, Any]) -> None:
    q, d = c["q"], c["d"]
    deep = 1 if d > 1 else 0
    tokens = c["batch"] // (q * d) * c["seq"]
    w = c["in"] * E
    for fwd, bwd, _, _ in run_threaded(q * q * d, _meter, c, "norm"):
        assert (fwd, bwd) == (16 * tokens + 2 * w // q, 16 * tokens + 2 * w // q + deep * 4 * w // q**2)
    table = c["out"] * c["in"] * E
    for fwd, bwd, _, _ in run_threaded(q * q * d, _meter, c, "embedding"):
        assert (fwd, bwd) == (table // q, table // q + deep * 2 * table // q**2)
    ids, out = c["batch"] * c["seq"] * 8, c["batch"] * c["seq"] * c["in"] * E
    for fwd, bwd, _, _ in run_threaded(q * q * d, _meter, c, "vocab"):
        assert (fwd, bwd) == (ids // d + out // (d * q), out // (d * q) + deep * 2 * table // q**2)
