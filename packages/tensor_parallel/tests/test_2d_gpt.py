"""Tier 1: the reference GPT under ``GPT_2D_PLAN`` on a 2 x 2 grid (tp=4, threaded ranks)
equals the serial GPT: every parameter gradient of the first step, gathered from the four
ranks by the shard specs ``parallelize`` recorded, and the loss curve of a few SGD steps;
with the token embedding split on the hidden (``GPT_2D_PLAN``) or the vocabulary too
(``GPT_2D_VOCAB_PLAN``). The same on a 3 x 3 grid (tp=9) with a GPT whose sizes q=3 divides
(hidden 36 = 9 x 4 for the grid-sharded biases and norms, 6 heads, vocabulary 63, batch 3).

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
from torch import Tensor

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import parallelize, shard_specs
from tessera.tensor_parallel.testing import Curve, assert_follows_serial, gather_by_specs, sgd_curve
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
CFG_Q3 = GPTConfig(vocab_size=63, seq_len=6, d_model=36, n_heads=6, n_layers=2)
STEPS, LR, BATCH = 4, 0.5, 4


def _serial(cfg: GPTConfig = CFG, batch: int = BATCH, steps: int = STEPS) -> Curve:
    idx, targets = make_batch(cfg, batch, seed=1)
    return sgd_curve(GPT(cfg, seed=0), lambda m: m.loss(idx, targets), steps=steps, lr=LR)


Out = tuple[Curve, dict[str, GridShardSpec], dict[str, Tensor]]


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
    curve = sgd_curve(model, lambda m: loss_2d(m, idx, targets, grid), steps=STEPS, lr=LR)
    specs = {n: s for n, s in shard_specs(model).items() if isinstance(s, GridShardSpec)}
    return curve, specs, gather_by_specs(model, curve[2], mesh.group("tp"), 4)


@pytest.mark.parametrize("how", ["parallelize_2d", "by-name", "bind", "vocab"])
def test_gpt_2d_gradients_and_sgd_loss_curve_equal_serial(how: str) -> None:
    serial = _serial()
    out = run_threaded(4, _parallel, how)
    assert_follows_serial(serial, [(curve, full) for curve, _, full in out], out[0][1])


def _parallel_q3(rank: int) -> Out:
    mesh = Mesh(Topology(tp=9, tp_mode=TPMode.TWO_D))
    grid = Grid2D.from_mesh(mesh)
    model = parallelize_2d(GPT(CFG_Q3, seed=0), mesh=mesh)
    idx, targets = make_batch(CFG_Q3, 3, seed=1)
    curve = sgd_curve(model, lambda m: loss_2d(m, idx, targets, grid), steps=3, lr=LR)
    specs = {n: s for n, s in shard_specs(model).items() if isinstance(s, GridShardSpec)}
    return curve, specs, gather_by_specs(model, curve[2], mesh.group("tp"), 9)


def test_gpt_2d_on_a_3x3_grid_follows_serial() -> None:
    serial = _serial(CFG_Q3, 3, 3)
    out = run_threaded(9, _parallel_q3)
    assert_follows_serial(serial, [(curve, full) for curve, _, full in out], out[0][1])


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
