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

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.comm import CommMeter, CommOp, Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.two_p5_d import (
    Embedding2p5D,
    Grid2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
)

E, Q = 4, 2  # fp32 bytes, grid side


@st.composite
def case(draw: st.DrawFn) -> dict[str, Any]:
    d = draw(st.sampled_from([2, 2, 1]))
    return {
        "d": d,
        "batch": Q * d * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 3)),
        "in": Q * Q * draw(st.integers(1, 3)),
        "out": Q * Q * draw(st.integers(1, 3)),
        "bias": draw(st.booleans()),
    }


def _meter(rank: int, c: dict[str, Any], kind: str) -> tuple[int, int, dict[CommOp, int]]:
    d = c["d"]
    grid = Grid2p5D.from_mesh(Mesh(Topology(tp=Q * Q * d, tp_mode=TPMode.TWO_P5_D, depth=d)))
    local = (c["batch"] // (Q * d), c["seq"])
    layer: nn.Module
    if kind == "linear":
        layer = Linear2p5D.from_dense(nn.Linear(c["in"], c["out"], bias=c["bias"]), grid)
        x = torch.randn(*local, c["in"] // Q, requires_grad=True)
    elif kind == "norm":
        layer = LayerNorm2p5D.from_dense(nn.LayerNorm(c["in"]), grid)
        x = torch.randn(*local, c["in"] // Q, requires_grad=True)
    else:
        table = nn.Embedding(c["out"], c["in"])
        layer = (VocabEmbedding2p5D if kind == "vocab" else Embedding2p5D).from_dense(table, grid)
        x = torch.randint(0, c["out"], local)
    with CommMeter() as fwd:
        y = layer(x)
    with CommMeter() as bwd:
        y.backward(torch.ones_like(y))
    return fwd.volume_bytes, bwd.volume_bytes, bwd.by_op()


@settings(max_examples=15, deadline=None)
@given(c=case())
def test_linear_2p5d_moves_the_tesseract_cost(c: dict[str, Any]) -> None:
    d = c["d"]
    x, w = c["batch"] * c["seq"] * c["in"] * E, c["in"] * c["out"] * E
    b = c["out"] * E if c["bias"] else 0
    depth = 2 * (w + b) // Q**2 if d > 1 else 0
    for fwd, bwd, ops in run_threaded(Q * Q * d, _meter, c, "linear"):
        assert fwd == (x // d + w) // Q + b // Q
        assert bwd == 2 * (x // d + w) // Q + b // Q + depth
        assert ops[CommOp.BROADCAST] == (x // d + w) // Q  # the re-broadcasts
        assert ops[CommOp.REDUCE_SCATTER] == (x // d + w) // Q + b // Q  # the SUMMA reduces
        assert ops.get(CommOp.ALL_REDUCE, 0) == depth  # weight gradients summed over depth


@settings(max_examples=10, deadline=None)
@given(c=case())
def test_layernorm_and_the_embeddings_2p5d_move_their_formulas(c: dict[str, Any]) -> None:
    d = c["d"]
    deep = 1 if d > 1 else 0
    tokens = c["batch"] // (Q * d) * c["seq"]
    w = c["in"] * E
    for fwd, bwd, _ in run_threaded(Q * Q * d, _meter, c, "norm"):
        assert (fwd, bwd) == (16 * tokens + 2 * w // Q, 16 * tokens + 2 * w // Q + deep * 4 * w // Q**2)
    table = c["out"] * c["in"] * E
    for fwd, bwd, _ in run_threaded(Q * Q * d, _meter, c, "embedding"):
        assert (fwd, bwd) == (table // Q, table // Q + deep * 2 * table // Q**2)
    ids, out = c["batch"] * c["seq"] * 8, c["batch"] * c["seq"] * c["in"] * E
    for fwd, bwd, _ in run_threaded(Q * Q * d, _meter, c, "vocab"):
        assert (fwd, bwd) == (ids // d + out // (d * Q), out // (d * Q) + deep * 2 * table // Q**2)
