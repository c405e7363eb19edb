"""Tier 1: each 3D layer's forward and backward equals the serial layer's, on threaded ranks
over a 2 x 2 x 2 cube (q=2: 8 ranks), hypothesis over shapes, batch, bias and orientation.

Each rank feeds its 3D block of a serial input (stream layout: batch block ``b*q + a`` of
q*q, hidden block c; branch layout: batch block ``b*q + c``, hidden block a) and of the
serial output gradient, and is held against the same block of the serial output and input
gradient and, for each parameter, against its shard (by the layer's ``CubeShardSpec``) of
the serial gradient.

Tolerance (fp32): ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the
*magnitudes* of the terms behind the value (the same layer run on absolute values of its
inputs, parameters and output gradient; for LayerNorm the analogous bound with the
cancellation of ``x - mean`` amplified by ``max|x| / std``). The 3D layers add the same
products as the serial ones in another order (q partial matmuls summed by a reduce-scatter,
the norm's statistics as sums of q partial sums, weight gradients reduce-scattered over the
batch blocks), and a reordered sum of n terms differs by at most about n * 2**-24 times the
sum of their magnitudes (n <= 48 here: under 3e-6). A bound on the value itself would be
wrong where terms cancel (a norm weight's gradient sums +-1 terms to nearly 0).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel.three_d import (
    EMBEDDING_SPEC,
    VOCAB_EMBEDDING_SPEC,
    Cube3D,
    CubeShardSpec,
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


def block(t: Tensor, cube: Cube3D, *, branch: bool = False) -> Tensor:
    """The 3D block of a serial tensor (batch on dim 0, hidden last) in the stream or branch layout."""
    q = cube.q
    batch, hidden = (cube.c, cube.a) if branch else (cube.a, cube.c)
    return t.chunk(q * q, 0)[cube.b * q + batch].chunk(q, -1)[hidden]


def shard(spec: CubeShardSpec, full: Tensor, cube: Cube3D) -> Tensor:
    return spec.shard(full, cube.tp_rank, cube.q**3)


def _cube() -> Cube3D:
    return Cube3D.from_mesh(Mesh(Topology(tp=Q**3, tp_mode=TPMode.THREE_D)))


def _gen(c: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(c["seed"])


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


@st.composite
def linear_case(draw: st.DrawFn) -> dict[str, Any]:
    bias = draw(st.booleans())
    return {
        "batch": Q * Q * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "in": Q * draw(st.integers(1, 4)),
        "out": (Q**3 if bias else Q * Q) * draw(st.integers(1, 3)),
        "bias": bias,
        "swapped": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _linear(rank: int, c: dict[str, Any]) -> None:
    cube, gen, swapped = _cube(), _gen(c), c["swapped"]
    serial = nn.Linear(c["in"], c["out"], bias=c["bias"])
    _randomize(serial, gen)
    x = torch.randn(c["batch"], c["seq"], c["in"], generator=gen, requires_grad=True)
    gy = torch.randn(c["batch"], c["seq"], c["out"], generator=gen)
    y = serial(x)
    y.backward(gy)
    par = Linear3D.from_dense(serial, cube, swapped=swapped)
    xb = block(x.detach(), cube, branch=swapped).requires_grad_()
    yb = par(xb)
    yb.backward(block(gy, cube, branch=not swapped))
    ya, gxa, ga = abs_twin(serial, x, gy)
    close(yb, block(y.detach(), cube, branch=not swapped), ya)
    assert xb.grad is not None and x.grad is not None and gxa is not None
    close(xb.grad, block(x.grad, cube, branch=swapped), gxa)
    assert par.weight.grad is not None and serial.weight.grad is not None
    close(par.weight.grad, shard(weight_spec(swapped), serial.weight.grad, cube), ga["weight"])
    if c["bias"]:
        assert par.bias is not None and par.bias.grad is not None and serial.bias.grad is not None
        close(par.bias.grad, shard(bias_spec(swapped), serial.bias.grad, cube), ga["bias"])


@settings(max_examples=25, deadline=None)
@given(c=linear_case())
def test_linear_3d_both_orientations_equal_serial(c: dict[str, Any]) -> None:
    run_threaded(Q**3, _linear, c)


@st.composite
def norm_case(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "batch": Q * Q * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "hidden": Q**3 * draw(st.integers(1, 3)),
        "shift": draw(st.sampled_from([0.0, 3.0])),  # a mean far from 0 tests the two-pass variance
        "swapped": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _norm(rank: int, c: dict[str, Any]) -> None:
    cube, gen, swapped = _cube(), _gen(c), c["swapped"]
    serial = nn.LayerNorm(c["hidden"])
    _randomize(serial, gen)
    shape = (c["batch"], c["seq"], c["hidden"])
    x = (torch.randn(shape, generator=gen) + c["shift"]).requires_grad_()
    gy = torch.randn(shape, generator=gen)
    y = serial(x)
    y.backward(gy)
    par = LayerNorm3D.from_dense(serial, cube, swapped=swapped)
    xb = block(x.detach(), cube, branch=swapped).requires_grad_()
    yb = par(xb)
    yb.backward(block(gy, cube, branch=swapped))
    xd = x.detach().double()
    std = (xd.var(-1, unbiased=False, keepdim=True) + serial.eps).sqrt()
    amp = xd.abs().amax(-1, keepdim=True) / std  # cancellation in x - mean, per token
    gw = (gy.double() * serial.weight.detach().double()).abs().amax(-1, keepdim=True)
    close(
        yb,
        block(y.detach(), cube, branch=swapped),
        amp.max() * serial.weight.abs().max() + serial.bias.abs().max(),
    )
    assert xb.grad is not None and x.grad is not None
    close(xb.grad, block(x.grad, cube, branch=swapped), (gw / std * (2 + amp**2)).max())
    tokens = (gy.abs().double() * amp).flatten(0, 1).sum(0)
    assert par.weight is not None and par.bias is not None
    assert par.weight.grad is not None and serial.weight.grad is not None
    assert par.bias.grad is not None and serial.bias.grad is not None
    spec = norm_spec(swapped)
    close(par.weight.grad, shard(spec, serial.weight.grad, cube), tokens.max())
    close(par.bias.grad, shard(spec, serial.bias.grad, cube), gy.abs().flatten(0, 1).sum(0).max())


@settings(max_examples=25, deadline=None)
@given(c=norm_case())
def test_layernorm_3d_equals_serial(c: dict[str, Any]) -> None:
    run_threaded(Q**3, _norm, c)


@st.composite
def embedding_case(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "batch": Q * Q * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 4)),
        "vocab": draw(st.integers(1, 12)),
        "hidden": Q**3 * draw(st.integers(1, 3)),
        "vocab_split": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _embedding(rank: int, c: dict[str, Any]) -> None:
    cube, gen = _cube(), _gen(c)
    vocab = c["vocab"] * (Q * Q if c["vocab_split"] else 1)
    serial = nn.Embedding(vocab, c["hidden"])
    _randomize(serial, gen)
    idx = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen)
    gy = torch.randn(c["batch"], c["seq"], c["hidden"], generator=gen)
    y = serial(idx)
    y.backward(gy)
    par: Embedding3D | VocabEmbedding3D
    if c["vocab_split"]:
        par, spec = VocabEmbedding3D.from_dense(serial, cube), VOCAB_EMBEDDING_SPEC
    else:
        par, spec = Embedding3D.from_dense(serial, cube), EMBEDDING_SPEC
    yb = par(idx.chunk(Q * Q, 0)[cube.b * Q + cube.a])
    yb.backward(block(gy, cube))
    _, _, ga = abs_twin(serial, idx, gy)
    close(yb, block(y.detach(), cube), 0.0)  # a lookup: exact
    assert par.weight.grad is not None and serial.weight.grad is not None
    close(par.weight.grad, shard(spec, serial.weight.grad, cube), ga["weight"])


@settings(max_examples=20, deadline=None)
@given(c=embedding_case())
def test_embedding_3d_hidden_and_vocab_split_equal_serial(c: dict[str, Any]) -> None:
    run_threaded(Q**3, _embedding, c)


@st.composite
def classifier_case(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "batch": Q * Q * draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 3)),
        "in": Q * draw(st.integers(1, 3)),
        "vocab": Q * Q * draw(st.integers(1, 4)),
        "ignore": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _classifier(rank: int, c: dict[str, Any]) -> float:
    cube, gen = _cube(), _gen(c)
    head = nn.Linear(c["in"], c["vocab"], bias=False)
    _randomize(head, gen)
    x = torch.randn(c["batch"], c["seq"], c["in"], generator=gen, requires_grad=True)
    targets = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=gen)
    if c["ignore"]:
        targets[0, 0] = -100  # one ignored token: the mean is over the others, globally
    loss = F.cross_entropy(head(x).flatten(0, 1), targets.flatten())
    torch.autograd.backward(loss)
    par = Linear3D.from_dense(head, cube)
    xb = block(x.detach(), cube).requires_grad_()
    got = cross_entropy_3d(par(xb), targets.chunk(Q * Q, 0)[cube.b * Q + cube.c], cube)
    torch.autograd.backward(got)
    # |softmax - one_hot| <= 1, so the gradients' terms are bounded by the twin's with |gy| = 1/N
    n = int((targets != -100).sum())
    za, gxa, ga = abs_twin(head, x, torch.full((c["batch"], c["seq"], c["vocab"]), 1.0 / n))
    close(got, loss.detach(), za)
    assert xb.grad is not None and x.grad is not None and gxa is not None
    close(xb.grad, block(x.grad, cube), gxa)
    assert par.weight.grad is not None and head.weight.grad is not None
    close(par.weight.grad, shard(weight_spec(False), head.weight.grad, cube), ga["weight"])
    return got.item()


@settings(max_examples=20, deadline=None)
@given(c=classifier_case())
def test_classifier_and_cross_entropy_3d_equal_serial(c: dict[str, Any]) -> None:
    losses = run_threaded(Q**3, _classifier, c)
    assert len(set(losses)) == 1  # the same loss on every rank


def _bad_linear(rank: int) -> None:
    Linear3D(5, 8, _cube(), bias=True)


def test_a_linear_the_cube_cannot_split_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"Linear3D: in_features=5 is not divisible by 2"):
        run_threaded(Q**3, _bad_linear)
