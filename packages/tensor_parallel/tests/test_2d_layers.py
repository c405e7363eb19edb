"""Tier 1: each 2D layer's forward and backward equals the serial layer's, on threaded ranks
over a q x q grid (q=2: 4 ranks, q=3: 9 ranks), hypothesis over shapes, batch and bias.

Each rank feeds its 2D block of a serial input (batch block i, feature block j) and of the
serial output gradient, and is held against the same block of the serial output and input
gradient and, for each parameter, against its shard (by the layer's ``GridShardSpec``) of the
serial gradient.

Tolerance (fp32): ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the
*magnitudes* of the terms that make up the value (the same layer run on absolute values of
its inputs, parameters and output gradient; for LayerNorm the analogous bound with the
cancellation of ``x - mean`` amplified by ``max|x| / std``). The 2D layers add the same
products as the serial ones in another order (SUMMA sums q partial matmuls, the norm's
statistics are sums of q partial sums, the weight gradients are reduce-scattered sums of
per-row partials), and a reordered sum of n terms differs by at most about n * 2**-24 times
the sum of their magnitudes (n <= 48 here: under 3e-6). A bound on the value itself would
be wrong where terms cancel (a norm weight's gradient sums +-1 terms to nearly 0).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.two_d import (
    BIAS_SPEC,
    EMBEDDING_SPEC,
    NORM_SPEC,
    VOCAB_EMBEDDING_SPEC,
    WEIGHT_SPEC,
    Embedding2D,
    Grid2D,
    GridShardSpec,
    LayerNorm2D,
    Linear2D,
    VocabEmbedding2D,
    cross_entropy_2d,
)

qs = st.sampled_from([2, 2, 3])  # q=3 (9 threads) a third of the time


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


def block(t: Tensor, grid: Grid2D) -> Tensor:
    """The 2D block (batch block i on dim 0, feature block j on the last dim) of a serial tensor."""
    return t.chunk(grid.q, 0)[grid.i].chunk(grid.q, -1)[grid.j]


def shard(spec: GridShardSpec, full: Tensor, grid: Grid2D) -> Tensor:
    return spec.shard(full, grid.tp_rank, grid.q * grid.q)


def _grid(c: dict[str, Any]) -> Grid2D:
    return Grid2D.from_mesh(Mesh(Topology(tp=c["q"] ** 2, tp_mode=TPMode.TWO_D)))


def _gen(c: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(c["seed"])


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


@st.composite
def linear_case(draw: st.DrawFn) -> dict[str, Any]:
    q = draw(qs)
    bias = draw(st.booleans())
    return {
        "q": q,
        "batch": q * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 3)),
        "in": q * draw(st.integers(1, 4)),
        "out": (q * q if bias else q) * draw(st.integers(1, 3)),
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
    par = Linear2D.from_dense(serial, grid)
    xb = block(x.detach(), grid).requires_grad_()
    yb = par(xb)
    yb.backward(block(gy, grid))
    ya, gxa, ga = abs_twin(serial, x, gy)
    close(yb, block(y.detach(), grid), ya)
    assert xb.grad is not None and par.weight.grad is not None and serial.weight.grad is not None
    close(xb.grad, block(x.grad, grid), gxa)  # type: ignore[arg-type]
    close(par.weight.grad, shard(WEIGHT_SPEC, serial.weight.grad, grid), ga["weight"])
    if c["bias"]:
        assert par.bias is not None and par.bias.grad is not None and serial.bias.grad is not None
        close(par.bias.grad, shard(BIAS_SPEC, serial.bias.grad, grid), ga["bias"])


@settings(max_examples=30)
@given(c=linear_case())
def test_linear_2d_equals_serial(c: dict[str, Any]) -> None:
    run_threaded(c["q"] ** 2, _linear, c)


@st.composite
def norm_case(draw: st.DrawFn) -> dict[str, Any]:
    q = draw(qs)
    return {
        "q": q,
        "batch": q * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 3)),
        "hidden": q * q * draw(st.integers(1, 3)),
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
    par = LayerNorm2D.from_dense(serial, grid)
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
    close(par.weight.grad, shard(NORM_SPEC, serial.weight.grad, grid), tokens.max())  # type: ignore[arg-type]
    bias_bound = gy.abs().flatten(0, 1).sum(0).max()
    close(par.bias.grad, shard(NORM_SPEC, serial.bias.grad, grid), bias_bound)  # type: ignore[arg-type]


@settings(max_examples=30)
@given(c=norm_case())
def test_layernorm_2d_equals_serial(c: dict[str, Any]) -> None:
    run_threaded(c["q"] ** 2, _norm, c)


@st.composite
def embedding_case(draw: st.DrawFn) -> dict[str, Any]:
    q = draw(qs)
    return {
        "q": q,
        "batch": q * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 4)),
        "vocab": draw(st.integers(1, 12)),
        "hidden": q * q * draw(st.integers(1, 3)),
        "vocab_split": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _embedding(rank: int, c: dict[str, Any]) -> None:
    grid, gen = _grid(c), _gen(c)
    vocab = c["vocab"] * (grid.q if c["vocab_split"] else 1)
    serial = nn.Embedding(vocab, c["hidden"])
    _randomize(serial, gen)
    idx = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen)
    gy = torch.randn(c["batch"], c["seq"], c["hidden"], generator=gen)
    y = serial(idx)
    y.backward(gy)
    par: Embedding2D | VocabEmbedding2D
    if c["vocab_split"]:
        par, spec = VocabEmbedding2D.from_dense(serial, grid), VOCAB_EMBEDDING_SPEC
    else:
        par, spec = Embedding2D.from_dense(serial, grid), EMBEDDING_SPEC
    yb = par(idx.chunk(grid.q, 0)[grid.i])
    yb.backward(block(gy, grid))
    _, _, ga = abs_twin(serial, idx, gy)
    close(yb, block(y.detach(), grid), 0.0)  # a lookup: exact
    close(par.weight.grad, shard(spec, serial.weight.grad, grid), ga["weight"])  # type: ignore[arg-type]


@settings(max_examples=30)
@given(c=embedding_case())
def test_embedding_2d_hidden_and_vocab_split_equal_serial(c: dict[str, Any]) -> None:
    run_threaded(c["q"] ** 2, _embedding, c)


@st.composite
def classifier_case(draw: st.DrawFn) -> dict[str, Any]:
    q = draw(qs)
    return {
        "q": q,
        "batch": q * draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 3)),
        "in": q * draw(st.integers(1, 3)),
        "vocab": q * draw(st.integers(1, 5)),
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
        targets[0, 0] = -100  # one ignored token: the mean is over the others, globally
    loss = F.cross_entropy(head(x).flatten(0, 1), targets.flatten())
    torch.autograd.backward(loss)
    par = Linear2D.from_dense(head, grid)
    xb = block(x.detach(), grid).requires_grad_()
    got = cross_entropy_2d(par(xb), targets.chunk(grid.q, 0)[grid.i], grid)
    torch.autograd.backward(got)
    # |softmax - one_hot| <= 1, so the gradients' terms are bounded by the twin's with |gy| = 1/N
    n = int((targets != -100).sum())
    za, gxa, ga = abs_twin(head, x, torch.full((c["batch"], c["seq"], c["vocab"]), 1.0 / n))
    close(got, loss.detach(), za)
    close(xb.grad, block(x.grad, grid), gxa)  # type: ignore[arg-type]
    close(par.weight.grad, shard(WEIGHT_SPEC, head.weight.grad, grid), ga["weight"])  # type: ignore[arg-type]
    return got.item()


@settings(max_examples=30)
@given(c=classifier_case())
def test_classifier_and_cross_entropy_2d_equal_serial(c: dict[str, Any]) -> None:
    losses = run_threaded(c["q"] ** 2, _classifier, c)
    assert len(set(losses)) == 1  # the same loss on every rank
