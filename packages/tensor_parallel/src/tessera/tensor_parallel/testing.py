"""Test support for the 2D, 2.5D and 3D tests: a model trained a few SGD steps, its
tensor-parallel twin's shards gathered by the recorded shard specs, and the comparison of the
two; and the per-rank drivers of the layer tests (``check_linear``, ``check_layernorm``,
``check_embedding``, ``check_classifier``, ``metered_layer``), which a mode's tests call with
its ``Layout``: where its layers put a serial tensor on this rank. ``gpt_plan`` and ``gpt_loss``
give the reference GPT's plan and global loss for a mesh's tensor-parallel mode.

Tolerances of ``assert_follows_serial`` (fp32): first-step gradients ``rtol=1e-4``, ``atol=1e-5``
times the largest serial gradient of that parameter (floored at 1e-2: some gradients, e.g.
the key biases, are zero in exact arithmetic and hold only round-off); losses ``rtol=1e-5``;
the weights after the steps ``rtol=1e-5``, ``atol=1e-6`` (they are O(0.02-1) and move by lr
times gradients that agree to the bound above). The parallel model adds the same products
in another order (partial sums over the grid's lines) through every layer, which compounds a
few ulps per layer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import CommMeter, CommOp, Group, Mesh, TPMode, all_gather
from tessera.tensor_parallel.parallelize import shard_specs
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.plan import Plan
from tessera.tensor_parallel.plans import GPT_PLAN, parallel_gpt_loss
from tessera.tensor_parallel.three_d import GPT_3D_PLAN, Cube3D, loss_3d
from tessera.tensor_parallel.two_d import GPT_2D_PLAN, Grid2D, loss_2d
from tessera.tensor_parallel.two_p5_d import GPT_2P5D_PLAN, Grid2p5D, loss_2p5d

__all__ = [
    "Curve",
    "Layout",
    "abs_twin",
    "assert_follows_serial",
    "check_classifier",
    "check_embedding",
    "check_layernorm",
    "check_linear",
    "close",
    "gather_by_specs",
    "gpt_loss",
    "gpt_plan",
    "metered_layer",
    "sgd_curve",
]

_GPT_PLANS = {
    TPMode.ONE_D: GPT_PLAN,
    TPMode.TWO_D: GPT_2D_PLAN,
    TPMode.TWO_P5_D: GPT_2P5D_PLAN,
    TPMode.THREE_D: GPT_3D_PLAN,
}


def gpt_plan(mesh: Mesh) -> Plan:
    """The reference GPT's plan for ``mesh``'s tensor-parallel mode."""
    return _GPT_PLANS[mesh.topology.tp_mode]


def gpt_loss(model: nn.Module, idx: Tensor, targets: Tensor, mesh: Mesh) -> Tensor:
    """The global mean loss of the reference GPT parallelized by ``gpt_plan(mesh)`` on the global
    batch (every rank passes all of it; the 2D, 2.5D and 3D losses take this rank's block)."""
    mode = mesh.topology.tp_mode
    if mode is TPMode.ONE_D:
        return parallel_gpt_loss(model, idx, targets, mesh.group("tp"))
    if mode is TPMode.TWO_D:
        return loss_2d(model, idx, targets, Grid2D.from_mesh(mesh))
    if mode is TPMode.TWO_P5_D:
        return loss_2p5d(model, idx, targets, Grid2p5D.from_mesh(mesh))
    return loss_3d(model, idx, targets, Cube3D.from_mesh(mesh))


Curve = tuple[list[float], dict[str, Tensor], dict[str, Tensor]]
"""(losses per step, first-step gradients by name, final weights by name)."""


def sgd_curve(model: nn.Module, loss_of: Callable[[nn.Module], Tensor], *, steps: int, lr: float) -> Curve:
    """Train ``model`` ``steps`` SGD steps on ``loss_of(model)``; its curve, with the weights as
    the model holds them (shards, for a parallel model)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model)
        torch.autograd.backward(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def gather_by_specs(model: nn.Module, weights: dict[str, Tensor], group: Group, tp: int) -> dict[str, Tensor]:
    """Full tensors of a parallel model's shards, by consolidation's path: all-gather each over
    the tp ``group`` along its spec's ``local_dim``, then ``unshard`` one chunk per rank."""
    specs = shard_specs(model)
    return {
        n: specs[n].unshard(all_gather(w, group, specs[n].local_dim).chunk(tp, specs[n].local_dim))
        for n, w in weights.items()
    }


def assert_follows_serial(
    serial: Curve, ranks: Sequence[tuple[Curve, dict[str, Tensor]]], specs: dict[str, ShardSpec]
) -> None:
    """Every rank's ``(curve, gathered weights)`` against the serial curve (module docstring):
    the first-step gradients unsharded by ``specs`` (every parameter split), the losses of
    every step, and the final weights."""
    serial_losses, serial_grads, serial_weights = serial
    assert set(specs) == set(serial_grads)  # every parameter of the model is split
    assert all(set(curve[1]) == set(serial_grads) for curve, _ in ranks)
    for name, want in serial_grads.items():
        got = specs[name].unshard([curve[1][name] for curve, _ in ranks])
        scale = max(want.abs().max().item(), 1e-2)
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
        except AssertionError as error:
            error.add_note(f"in the gradient of {name}")
            raise
    for (losses, _, _), weights in ranks:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(serial_losses), rtol=1e-5, atol=0.0)
        for name, want in serial_weights.items():
            try:
                torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the weight {name} after {len(losses)} SGD steps, gathered")
                raise
    assert serial_losses[-1] < serial_losses[0]  # the steps do train


# ---------------------------------------------------------------- the layer tests' drivers
#
# Each driver builds a serial layer from the case ``c`` (a hypothesis draw: sizes and a
# ``seed``), runs it forward and backward on random data, converts it with ``make``, feeds
# this rank its blocks of the same data, and holds the output, the input gradient and each
# parameter's gradient shard against the serial ones with ``close``. Tolerance (fp32):
# ``rtol=1e-5`` and ``atol=1e-5 * bound``, ``bound`` the largest sum of the magnitudes of the
# terms behind the value (``abs_twin``; for LayerNorm the analogous bound with the
# cancellation of ``x - mean`` amplified by ``max|x| / std``): the parallel layers add the
# same products in another order, and a reordered sum of n terms differs by at most about
# n * 2**-24 times the sum of their magnitudes (n <= 48 in these tests: under 3e-6). A bound
# on the value itself would be wrong where terms cancel (a norm weight's gradient).


class Layout(Protocol):
    """Where a mode's layers put a serial tensor on this rank (batch on dim 0, hidden last);
    ``branch`` picks 3D's second layout (the others have one)."""

    def rows(self, t: Tensor, *, branch: bool = False) -> Tensor:
        """This rank's batch block (ids, targets)."""
        ...

    def block(self, t: Tensor, *, branch: bool = False) -> Tensor:
        """This rank's batch block and hidden block (activations, their gradients)."""
        ...

    def shard(self, spec: ShardSpec, full: Tensor) -> Tensor:
        """This rank's shard of a serial parameter (or its gradient) by ``spec``."""
        ...

    def check_replicas(self, grad: Tensor) -> None:
        """Assert that the copies of a replicated parameter's gradient agree (2.5D's depth)."""
        ...


def close(got: Tensor, serial: Tensor, bound: Tensor | float) -> None:
    """fp32 round-off of a reordered sum whose terms' magnitudes sum to ``bound`` (see above)."""
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


def _seeded(module: nn.Module, c: Mapping[str, Any]) -> torch.Generator:
    """A generator seeded by the case, after drawing ``module``'s parameters from it."""
    gen = torch.Generator().manual_seed(int(c["seed"]))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return gen


def _grad(t: Tensor) -> Tensor:
    assert t.grad is not None
    return t.grad


def check_linear(
    c: Mapping[str, Any],
    layout: Layout,
    make: Callable[[nn.Linear], nn.Module],
    specs: tuple[ShardSpec, ShardSpec],
    *,
    branch: tuple[bool, bool] = (False, False),
) -> None:
    """``make(nn.Linear(c["in"], c["out"], bias=c["bias"]))`` on (c["batch"], c["seq"], in) equals
    the serial layer (see above); ``specs`` shard its weight and bias, ``branch`` says in which
    layout its input and its output are (3D: one of each)."""
    serial = nn.Linear(c["in"], c["out"], bias=c["bias"])
    gen = _seeded(serial, c)
    x = torch.randn(c["batch"], c["seq"], c["in"], generator=gen, requires_grad=True)
    gy = torch.randn(c["batch"], c["seq"], c["out"], generator=gen)
    y = serial(x)
    y.backward(gy)
    par = make(serial)
    xb = layout.block(x.detach(), branch=branch[0]).requires_grad_()
    yb = par(xb)
    yb.backward(layout.block(gy, branch=branch[1]))
    ya, gxa, ga = abs_twin(serial, x, gy)
    assert gxa is not None
    close(yb, layout.block(y.detach(), branch=branch[1]), ya)
    close(_grad(xb), layout.block(_grad(x), branch=branch[0]), gxa)
    _check_params(layout, par, serial, specs, ga)


def _check_params(
    layout: Layout,
    par: nn.Module,
    serial: nn.Module,
    specs: tuple[ShardSpec, ...],
    bounds: Mapping[str, Tensor],
) -> None:
    """Each gradient of ``serial``'s weight (and bias) against ``par``'s shard, by ``specs``."""
    for (name, param), spec in zip(serial.named_parameters(), specs, strict=False):
        got = _grad(par.get_parameter(name))
        close(got, layout.shard(spec, _grad(param)), bounds[name])
        layout.check_replicas(got)


def check_layernorm(
    c: Mapping[str, Any],
    layout: Layout,
    make: Callable[[nn.LayerNorm], nn.Module],
    spec: ShardSpec,
    *,
    branch: bool = False,
) -> None:
    """``make(nn.LayerNorm(c["hidden"]))`` on (c["batch"], c["seq"], hidden) inputs shifted by
    c["shift"] equals the serial norm (see above), its affine sharded by ``spec``."""
    serial = nn.LayerNorm(c["hidden"])
    gen = _seeded(serial, c)
    shape = (c["batch"], c["seq"], c["hidden"])
    x = (torch.randn(shape, generator=gen) + c["shift"]).requires_grad_()
    gy = torch.randn(shape, generator=gen)
    y = serial(x)
    y.backward(gy)
    par = make(serial)
    xb = layout.block(x.detach(), branch=branch).requires_grad_()
    yb = par(xb)
    yb.backward(layout.block(gy, branch=branch))
    xd = x.detach().double()
    std = (xd.var(-1, unbiased=False, keepdim=True) + serial.eps).sqrt()
    amp = xd.abs().amax(-1, keepdim=True) / std  # cancellation in x - mean, per token
    gw = (gy.double() * serial.weight.detach().double()).abs().amax(-1, keepdim=True)
    out_bound = amp.max() * serial.weight.abs().max() + serial.bias.abs().max()
    close(yb, layout.block(y.detach(), branch=branch), out_bound)
    close(_grad(xb), layout.block(_grad(x), branch=branch), (gw / std * (2 + amp**2)).max())
    bounds = {
        "weight": (gy.abs().double() * amp).flatten(0, 1).sum(0).max(),
        "bias": gy.abs().flatten(0, 1).sum(0).max(),
    }
    _check_params(layout, par, serial, (spec, spec), bounds)


def check_embedding(
    c: Mapping[str, Any], layout: Layout, make: Callable[[nn.Embedding], nn.Module], spec: ShardSpec
) -> None:
    """``make(nn.Embedding(c["vocab"], c["hidden"]))`` on this rank's rows of (c["batch"],
    c["seq"]) ids equals the serial lookup exactly, and its weight gradient the serial one's
    shard by ``spec`` (see above)."""
    vocab = c["vocab"]
    serial = nn.Embedding(vocab, c["hidden"])
    gen = _seeded(serial, c)
    idx = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen)
    gy = torch.randn(c["batch"], c["seq"], c["hidden"], generator=gen)
    y = serial(idx)
    y.backward(gy)
    par = make(serial)
    yb = par(layout.rows(idx))
    yb.backward(layout.block(gy))
    _, _, ga = abs_twin(serial, idx, gy)
    close(yb, layout.block(y.detach()), 0.0)  # a lookup: exact
    _check_params(layout, par, serial, (spec,), ga)


def check_classifier(
    c: Mapping[str, Any],
    layout: Layout,
    make: Callable[[nn.Linear], nn.Module],
    spec: ShardSpec,
    loss: Callable[[Tensor, Tensor], Tensor],
) -> float:
    """A bias-free ``nn.Linear(c["in"], c["vocab"])`` head made by ``make``, then ``loss(logits,
    targets)`` of this rank's blocks (targets in the logits' layout, which is the branch one in
    3D), equals ``F.cross_entropy`` of the serial head, with one target ignored when
    c["ignore"]; returns this rank's loss."""
    head = nn.Linear(c["in"], c["vocab"], bias=False)
    gen = _seeded(head, c)
    x = torch.randn(c["batch"], c["seq"], c["in"], generator=gen, requires_grad=True)
    targets = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=gen)
    if c["ignore"]:
        targets[0, 0] = -100  # one ignored token: the mean is over the others, globally
    want = F.cross_entropy(head(x).flatten(0, 1), targets.flatten())
    torch.autograd.backward(want)
    par = make(head)
    xb = layout.block(x.detach()).requires_grad_()
    got = loss(par(xb), layout.rows(targets, branch=True))
    torch.autograd.backward(got)
    # |softmax - one_hot| <= 1, so the gradients' terms are bounded by the twin's with |gy| = 1/N
    n = int((targets != -100).sum())
    za, gxa, ga = abs_twin(head, x, torch.full((c["batch"], c["seq"], c["vocab"]), 1.0 / n))
    assert gxa is not None
    close(got, want.detach(), za)
    close(_grad(xb), layout.block(_grad(x)), gxa)
    _check_params(layout, par, head, (spec,), ga)
    return float(got.item())


def metered_layer(
    kind: str, c: Mapping[str, Any], *, rows: int, q: int, make: Callable[[str, nn.Module], nn.Module]
) -> tuple[int, int, dict[CommOp, int], dict[CommOp, int]]:
    """Bytes moved by one layer: a serial ``kind`` ("linear": ``nn.Linear(c["in"], c["out"],
    bias=c["bias"])``, "norm": ``nn.LayerNorm(c["in"])``, "embedding" / "vocab":
    ``nn.Embedding(c["out"], c["in"])``) converted by ``make(kind, serial)``, fed (rows,
    c["seq"]) ids or a (rows, c["seq"], in/q) input: (forward bytes, backward bytes, forward
    and backward bytes per kind of call)."""
    serial: nn.Module
    x: Tensor
    if kind == "linear":
        serial = nn.Linear(c["in"], c["out"], bias=c["bias"])
    elif kind == "norm":
        serial = nn.LayerNorm(c["in"])
    else:
        serial = nn.Embedding(c["out"], c["in"])
    if kind in ("linear", "norm"):
        x = torch.randn(rows, c["seq"], c["in"] // q, requires_grad=True)
    else:
        x = torch.randint(0, c["out"], (rows, c["seq"]))
    layer = make(kind, serial)
    with CommMeter() as fwd:
        y = layer(x)
    with CommMeter() as bwd:
        y.backward(torch.ones_like(y))
    return fwd.volume_bytes, bwd.volume_bytes, fwd.by_op(), bwd.by_op()
