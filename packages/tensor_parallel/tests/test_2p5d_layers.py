"""Tier 1: each 2.5D layer's forward and backward equals the serial layer's, on threaded ranks
over a q x q x d grid (q=2, d=2: 8 ranks; d=1 a quarter of the time, the 2D case), hypothesis
over shapes, batch and bias.

Each rank feeds its 2.5D block of a serial input (batch block ``k*q + i`` of q*d, feature
block j) and of the serial output gradient, and is held against the same block of the serial
output and input gradient and, for each parameter, against its shard (by the layer's
``DepthShardSpec``) of the serial gradient; the d depth replicas of a parameter must also
get bitwise-equal gradients (one all-reduce gives every rank the same sum).

Tolerance (fp32): ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the
*magnitudes* of the terms that make up the value (the same layer run on absolute values of
its inputs, parameters and output gradient; for LayerNorm the analogous bound with the
cancellation of ``x - mean`` amplified by ``max|x| / std``), as in the 2D tests. The 2.5D
layers add the same products as the serial ones in another order (SUMMA's q partial
matmuls, the per-row partial statistics, the weight gradients summed over the column and
then over the depth), and a reordered sum of n terms differs by at most about n * 2**-24
times the sum of their magnitudes (n <= 48 here: under 3e-6).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode, all_gather
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.two_d import (
    BIAS_SPEC,
    EMBEDDING_SPEC,
    NORM_SPEC,
    VOCAB_EMBEDDING_SPEC,
    WEIGHT_SPEC,
)
from tessera.tensor_parallel.two_d.grid import GridShardSpec
from tessera.tensor_parallel.two_p5_d import (
    DepthShardSpec,
    Embedding2p5D,
    Grid2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
    cross_entropy_2p5d,
)

Q = 2
depths = st.sampled_from([2, 2, 2, 1])


def close(got: Tensor, serial: Tensor, bound: Tensor | float) -> None:
    """See the module: fp32 round-off of a reordered sum whose terms' magnitudes sum to ``bound``."""
    scale = float(bound.detach().abs().max()) if isinstance(bound, Tensor) else bound
    torch.testing.assert_close(got, serial, rtol=1e-5, atol=1e-5 * scale)


def abs_twin(module: nn.Module, x: Tensor, gy: Tensor) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """The module run on |x| with |parameters| and backward of |gy|: the sums of the magnitudes
    of the terms behind the output, the input gradient and each parameter gradient."""
    twin = copy.deepcopy(module)
    with torch.no_grad():
        for p in twin.parameters():
            p.abs_()
            p.grad = None
    xa = x.detach().abs().requires_grad_() if x.is_floating_point() else x
    y = twin(xa)
    y.backward(gy.abs())
    grads = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
    return y.detach(), (xa.grad if x.is_floating_point() else None), grads


def rows(t: Tensor, grid: Grid2p5D) -> Tensor:
    """This rank's batch block ``k*q + i`` (of q*d, dim 0) of a serial tensor."""
    return t.chunk(grid.q * grid.d, 0)[grid.batch_index]


def block(t: Tensor, grid: Grid2p5D) -> Tensor:
    """The 2.5D block (batch block k*q+i on dim 0, feature block j on the last dim)."""
    return rows(t, grid).chunk(grid.q, -1)[grid.j]


def shard(spec: GridShardSpec, full: Tensor, grid: Grid2p5D) -> Tensor:
    """This rank's shard by the 2D spec ``spec`` replicated over the depth (``DepthShardSpec``)."""
    depth_spec = DepthShardSpec(i_dim=spec.i_dim, j_dim=spec.j_dim, depth=grid.d)
    return depth_spec.shard(full, grid.tesseract_rank, grid.q * grid.q * grid.d)


def same_over_depth(grad: Tensor, grid: Grid2p5D) -> None:
    """The d replicas of a parameter hold bitwise-equal gradients."""
    for other in all_gather(grad.unsqueeze(0), grid.dep, 0):
        assert torch.equal(other, grad)


def _grid(c: dict[str, Any]) -> Grid2p5D:
    d = c["d"]
    return Grid2p5D.from_mesh(Mesh(Topology(tp=Q * Q * d, tp_mode=TPMode.TWO_P5_D, depth=d)))


def _gen(c: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(c["seed"])


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def _run(c: dict[str, Any], fn: Any) -> list[Any]:
    return run_threaded(Q * Q * c["d"], fn, c)


@st.composite
def linear_case(draw: st.DrawFn) -> dict[str, Any]:
    d = draw(depths)
    bias = draw(st.booleans())
    return {
        "d": d,
        "batch": Q * d * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "in": Q * draw(st.integers(1, 4)),
        "out": (Q * Q if bias else Q) * draw(st.integers(1, 3)),
        "bias": bias,
        "seed": draw(st.integers(0, 2**16)),
    }


def _linear(rank: int, c: dict[str, Any]) -> None:
    grid, gen = _grid(c), _gen(c)
    serial = nn.Linear(c["in"], c["out"], bias=c["bias"])
    _randomize(serial, gen)
    x = torch.randn(c["batch"], c["seq"], c["in"], generator=gen, requires_grad=True)
    gy = torch.randn(c["batch"], c["seq"], c["out"], generator=gen)
    y = serial(x)
    y.backward(gy)
    par = Linear2p5D.from_dense(serial, grid)
    xb = block(x.detach(), grid).requires_grad_()
    yb = par(xb)
    yb.backward(block(gy, grid))
    ya, gxa, ga = abs_twin(serial, x, gy)
    close(yb, block(y.detach(), grid), ya)
    assert xb.grad is not None and par.weight.grad is not None and serial.weight.grad is not None
    close(xb.grad, block(x.grad, grid), gxa)  # type: ignore[arg-type]
    close(par.weight.grad, shard(WEIGHT_SPEC, serial.weight.grad, grid), ga["weight"])
    same_over_depth(par.weight.grad, grid)
    if c["bias"]:
        assert par.bias is not None and par.bias.grad is not None and serial.bias.grad is not None
        close(par.bias.grad, shard(BIAS_SPEC, serial.bias.grad, grid), ga["bias"])
        same_over_depth(par.bias.grad, grid)


@settings(max_examples=15, deadline=None)
@given(c=linear_case())
def test_linear_2p5d_equals_serial(c: dict[str, Any]) -> None:
    _run(c, _linear)


@st.composite
def norm_case(draw: st.DrawFn) -> dict[str, Any]:
    d = draw(depths)
    return {
        "d": d,
        "batch": Q * d * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "hidden": Q * Q * draw(st.integers(1, 3)),
        "shift": draw(st.sampled_from([0.0, 3.0])),  # a mean far from 0 tests the two-pass variance
        "seed": draw(st.integers(0, 2**16)),
    }


def _norm(rank: int, c: dict[str, Any]) -> None:
    grid, gen = _grid(c), _gen(c)
    serial = nn.LayerNorm(c["hidden"])
    _randomize(serial, gen)
    shape = (c["batch"], c["seq"], c["hidden"])
    x = (torch.randn(shape, generator=gen) + c["shift"]).requires_grad_()
    gy = torch.randn(shape, generator=gen)
    y = serial(x)
    y.backward(gy)
    par = LayerNorm2p5D.from_dense(serial, grid)
    xb = block(x.detach(), grid).requires_grad_()
    yb = par(xb)
    yb.backward(block(gy, grid))
    xd = x.detach().double()
    std = (xd.var(-1, unbiased=False, keepdim=True) + serial.eps).sqrt()
    amp = xd.abs().amax(-1, keepdim=True) / std  # cancellation in x - mean, per token
    gw = (gy.double() * serial.weight.detach().double()).abs().amax(-1, keepdim=True)
    close(yb, block(y.detach(), grid), amp.max() * serial.weight.abs().max() + serial.bias.abs().max())
    close(xb.grad, block(x.grad, grid), (gw / std * (2 + amp**2)).max())  # type: ignore[arg-type]
    tokens = (gy.abs().double() * amp).flatten(0, 1).sum(0)
    assert par.weight is not None and par.bias is not None
    assert par.weight.grad is not None and par.bias.grad is not None
    close(par.weight.grad, shard(NORM_SPEC, serial.weight.grad, grid), tokens.max())  # type: ignore[arg-type]
    bias_bound = gy.abs().flatten(0, 1).sum(0).max()
    close(par.bias.grad, shard(NORM_SPEC, serial.bias.grad, grid), bias_bound)  # type: ignore[arg-type]
    same_over_depth(par.weight.grad, grid)
    same_over_depth(par.bias.grad, grid)


@settings(max_examples=15, deadline=None)
@given(c=norm_case())
def test_layernorm_2p5d_equals_serial(c: dict[str, Any]) -> None:
    _run(c, _norm)


@st.composite
def embedding_case(draw: st.DrawFn) -> dict[str, Any]:
    d = draw(depths)
    return {
        "d": d,
        "batch": Q * d * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 4)),
        "vocab": draw(st.integers(1, 12)),
        "hidden": Q * Q * draw(st.integers(1, 3)),
        "vocab_split": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _embedding(rank: int, c: dict[str, Any]) -> None:
    grid, gen = _grid(c), _gen(c)
    vocab = c["vocab"] * (Q if c["vocab_split"] else 1)
    serial = nn.Embedding(vocab, c["hidden"])
    _randomize(serial, gen)
    idx = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen)
    gy = torch.randn(c["batch"], c["seq"], c["hidden"], generator=gen)
    y = serial(idx)
    y.backward(gy)
    par: Embedding2p5D | VocabEmbedding2p5D
    if c["vocab_split"]:
        par, spec = VocabEmbedding2p5D.from_dense(serial, grid), VOCAB_EMBEDDING_SPEC
    else:
        par, spec = Embedding2p5D.from_dense(serial, grid), EMBEDDING_SPEC
    yb = par(rows(idx, grid))
    yb.backward(block(gy, grid))
    _, _, ga = abs_twin(serial, idx, gy)
    close(yb, block(y.detach(), grid), 0.0)  # a lookup: exact
    assert par.weight.grad is not None
    close(par.weight.grad, shard(spec, serial.weight.grad, grid), ga["weight"])  # type: ignore[arg-type]
    same_over_depth(par.weight.grad, grid)


@settings(max_examples=15, deadline=None)
@given(c=embedding_case())
def test_embedding_2p5d_hidden_and_vocab_split_equal_serial(c: dict[str, Any]) -> None:
    _run(c, _embedding)


@st.composite
def classifier_case(draw: st.DrawFn) -> dict[str, Any]:
    d = draw(depths)
    return {
        "d": d,
        "batch": Q * d * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "in": Q * draw(st.integers(1, 3)),
        "vocab": Q * draw(st.integers(1, 5)),
        "ignore": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _classifier(rank: int, c: dict[str, Any]) -> float:
    grid, gen = _grid(c), _gen(c)
    head = nn.Linear(c["in"], c["vocab"], bias=False)
    _randomize(head, gen)
    x = torch.randn(c["batch"], c["seq"], c["in"], generator=gen, requires_grad=True)
    targets = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=gen)
    if c["ignore"]:
        targets[0, 0] = -100  # one ignored token (on depth 0): the mean is over the others, globally
    loss = F.cross_entropy(head(x).flatten(0, 1), targets.flatten())
    torch.autograd.backward(loss)
    par = Linear2p5D.from_dense(head, grid)
    xb = block(x.detach(), grid).requires_grad_()
    got = cross_entropy_2p5d(par(xb), rows(targets, grid), grid)
    torch.autograd.backward(got)
    # |softmax - one_hot| <= 1, so the gradients' terms are bounded by the twin's with |gy| = 1/N
    n = int((targets != -100).sum())
    za, gxa, ga = abs_twin(head, x, torch.full((c["batch"], c["seq"], c["vocab"]), 1.0 / n))
    close(got, loss.detach(), za)
    close(xb.grad, block(x.grad, grid), gxa)  # type: ignore[arg-type]
    assert par.weight.grad is not None
    close(par.weight.grad, shard(WEIGHT_SPEC, head.weight.grad, grid), ga["weight"])  # type: ignore[arg-type]
    return got.item()


@settings(max_examples=15, deadline=None)
@given(c=classifier_case())
def test_classifier_and_cross_entropy_2p5d_equal_serial(c: dict[str, Any]) -> None:
    losses = _run(c, _classifier)
    assert len(set(losses)) == 1  # the same loss on every rank
