"""Tier 1: the reference GPT under ``GPT_2D_PLAN`` on a 2 x 2 grid (tp=4, threaded ranks)
equals the serial GPT: every parameter gradient of the first step, gathered from the four
ranks by the shard specs ``parallelize`` recorded, and the loss curve of a few SGD steps;
with the token embedding split on the hidden (``GPT_2D_PLAN``) or the vocabulary too
(``GPT_2D_VOCAB_PLAN``).

Tolerances (fp32): gradients ``rtol=1e-4``, ``atol=1e-5`` times the largest serial gradient
of that parameter (floored at 1e-2: some gradients, e.g. the key biases, are zero in exact
arithmetic and hold only round-off); losses ``rtol=1e-5``; the weights after the steps,
gathered over tp as consolidation does, ``rtol=1e-5``, ``atol=1e-6`` (they are O(0.02-1)
and move by lr times gradients that agree to the bound above). The 2D model adds the same
products in another order (SUMMA partial sums, per-row partial norms, reduce-scattered
weight gradients) through two layers, attention and the loss, which compounds a few ulps
per layer; SGD (lr 0.5) moves the weights by the gradients, so its steps stay that close.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tessera.comm import Mesh, Topology, TPMode, all_gather
from tessera.comm.testing import GPT, GPTConfig, make_batch, run_threaded
from tessera.tensor_parallel import parallelize, shard_specs
from tessera.tensor_parallel.two_d import (
    GPT_2D_PLAN,
    GPT_2D_VOCAB_PLAN,
    Grid2D,
    GridShardSpec,
    bind_2d,
    loss_2d,
    parallelize_2d,
)

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
STEPS, LR, BATCH = 4, 0.5, 4


def _serial() -> tuple[list[float], dict[str, Tensor], dict[str, Tensor]]:
    model = GPT(CFG, seed=0)
    idx, targets = make_batch(CFG, BATCH, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = model.loss(idx, targets)
        torch.autograd.backward(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


Out = tuple[list[float], dict[str, Tensor], dict[str, GridShardSpec], dict[str, Tensor]]


def _parallel(rank: int, how: str) -> Out:
    mesh = Mesh(Topology(tp=4, tp_mode=TPMode.TWO_D))
    grid = Grid2D.from_mesh(mesh)
    if how == "parallelize_2d":
        model = parallelize_2d(GPT(CFG, seed=0), mesh=mesh)
    elif how == "by-name":  # the registered styles find the grid in the 2d mesh
        model = parallelize(GPT(CFG, seed=0), plan=GPT_2D_PLAN, mesh=mesh)
    else:  # plain parallelize with the plan's 2D styles bound to the grid
        plan = GPT_2D_VOCAB_PLAN if how == "vocab" else GPT_2D_PLAN
        model = parallelize(GPT(CFG, seed=0), plan=bind_2d(plan, grid), mesh=mesh)
    idx, targets = make_batch(CFG, BATCH, seed=1)  # the global batch; loss_2d takes block i
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_2d(model, idx, targets, grid)
        torch.autograd.backward(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    specs = {n: s for n, s in shard_specs(model).items() if isinstance(s, GridShardSpec)}
    # consolidation's path: all-gather each shard over tp along local_dim, unshard in rank order
    tp = mesh.group("tp")
    full = {
        n: specs[n].unshard(all_gather(p.detach(), tp, specs[n].local_dim).chunk(4, specs[n].local_dim))
        for n, p in model.named_parameters()
    }
    return losses, grads, specs, full


@pytest.mark.parametrize("how", ["parallelize_2d", "by-name", "bind", "vocab"])
def test_gpt_2d_gradients_and_sgd_loss_curve_equal_serial(how: str) -> None:
    serial_losses, serial_grads, serial_weights = _serial()
    out = run_threaded(4, _parallel, how)
    specs = out[0][2]
    assert set(serial_grads) == set(out[0][1])
    assert set(specs) == set(serial_grads)  # every parameter of the GPT is split over the grid
    for name, want in serial_grads.items():
        got = specs[name].unshard([grads[name] for _, grads, _, _ in out])
        scale = max(want.abs().max().item(), 1e-2)
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
        except AssertionError as error:
            error.add_note(f"in the gradient of {name}")
            raise
    for losses, _, _, weights in out:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(serial_losses), rtol=1e-5, atol=0.0)
        for name, want in serial_weights.items():
            try:
                torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the weight {name} after {STEPS} SGD steps, gathered")
                raise
    assert serial_losses[-1] < serial_losses[0]  # the steps do train


def _unbound(rank: int) -> None:
    parallelize(GPT(CFG, seed=0), plan=GPT_2D_PLAN, mesh=Mesh(Topology(tp=4)))


def test_the_2d_plan_over_a_1d_mesh_says_it_needs_a_2d_one() -> None:
    with pytest.raises(ValueError, match=r"tp_mode='2d'.*tp=4 tp_mode=1d"):
        run_threaded(4, _unbound)


def _one_d_mesh(rank: int) -> None:
    Grid2D.from_mesh(Mesh(Topology(tp=4)))


def test_a_1d_mesh_has_no_grid() -> None:
    with pytest.raises(ValueError, match=r"tp_mode='2d'.*tp=4 tp_mode=1d"):
        run_threaded(4, _one_d_mesh)
