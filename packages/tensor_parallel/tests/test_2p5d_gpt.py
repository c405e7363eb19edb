"""Tier 1: the reference GPT under ``GPT_2P5D_PLAN`` on a 2 x 2 x 2 grid (tp=8, threaded ranks)
equals the serial GPT: every parameter gradient of the first step, gathered from the eight
ranks by the shard specs ``parallelize`` recorded (consolidation's path: all-gather over the
whole tp group, ``unshard`` one chunk per tp rank, which keeps depth 0's copies), and the
loss curve of a few SGD steps; by ``parallelize_2p5d`` (depth bound), by the registered
names over the 2.5d mesh (specs find q from the serial shapes), and with the token embedding
split on the vocabulary (``GPT_2P5D_VOCAB_PLAN``).

Tolerances (fp32), as for 2D: gradients ``rtol=1e-4``, ``atol=1e-5`` times the largest serial
gradient of that parameter (floored at 1e-2: some gradients, e.g. the key biases, are zero in
exact arithmetic and hold only round-off); losses ``rtol=1e-5``; the weights after the steps
``rtol=1e-5``, ``atol=1e-6`` (they are O(0.02-1) and move by lr times gradients that agree to
the bound above). The 2.5D model adds the same products in another order (SUMMA partial
sums, per-row partial norms, weight gradients summed over the column, then the depth)
through two layers, attention and the loss, which compounds a few ulps per layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import parallelize, shard_specs
from tessera.tensor_parallel.testing import Curve, assert_follows_serial, gather_by_specs, sgd_curve
from tessera.tensor_parallel.two_p5_d import (
    GPT_2P5D_PLAN,
    GPT_2P5D_VOCAB_PLAN,
    DepthShardSpec,
    Grid2p5D,
    loss_2p5d,
    parallelize_2p5d,
)

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
STEPS, LR, BATCH, TP = 4, 0.5, 8, 8


def _serial() -> Curve:
    idx, targets = make_batch(CFG, BATCH, seed=1)
    return sgd_curve(GPT(CFG, seed=0), lambda m: m.loss(idx, targets), steps=STEPS, lr=LR)


Out = tuple[Curve, dict[str, DepthShardSpec], dict[str, Tensor]]


def _parallel(rank: int, how: str) -> Out:
    mesh = Mesh(Topology(tp=TP, tp_mode=TPMode.TWO_P5_D, tp_depth=2))
    grid = Grid2p5D.from_mesh(mesh)
    if how == "parallelize_2p5d":
        model = parallelize_2p5d(GPT(CFG, seed=0), mesh=mesh)
    elif how == "by-name":  # the registered styles find the grid in the 2.5d mesh
        model = parallelize(GPT(CFG, seed=0), plan=GPT_2P5D_PLAN, mesh=mesh)
    else:
        model = parallelize_2p5d(GPT(CFG, seed=0), plan=GPT_2P5D_VOCAB_PLAN, mesh=mesh)
    idx, targets = make_batch(CFG, BATCH, seed=1)  # the global batch; loss_2p5d takes block k*q+i
    curve = sgd_curve(model, lambda m: loss_2p5d(m, idx, targets, grid), steps=STEPS, lr=LR)
    specs = {n: s for n, s in shard_specs(model).items() if isinstance(s, DepthShardSpec)}
    return curve, specs, gather_by_specs(model, curve[2], mesh.group("tp"), TP)


@pytest.mark.parametrize("how", ["parallelize_2p5d", "by-name", "vocab"])
def test_gpt_2p5d_gradients_and_sgd_loss_curve_equal_serial(how: str) -> None:
    serial = _serial()
    out = run_threaded(TP, _parallel, how)
    assert_follows_serial(serial, [(curve, full) for curve, _, full in out], out[0][1])
    for name in serial[1]:  # depth k holds depth 0's copy of every gradient, bitwise
        for rank, (curve, _, _) in enumerate(out):
            assert torch.equal(curve[1][name], out[rank % 4][0][1][name]), (name, rank)


def _two_d_mesh(rank: int) -> None:
    parallelize(GPT(CFG, seed=0), plan=GPT_2P5D_PLAN, mesh=Mesh(Topology(tp=4, tp_mode=TPMode.TWO_D)))


def test_the_2p5d_plan_over_a_2d_mesh_says_it_needs_a_2p5d_one() -> None:
    with pytest.raises(ValueError, match=r"tp_mode='2.5d'.*tp=4 tp_mode=2d"):
        run_threaded(4, _two_d_mesh)


def _odd_batch(rank: int) -> None:
    mesh = Mesh(Topology(tp=TP, tp_mode=TPMode.TWO_P5_D, tp_depth=2))
    model = parallelize_2p5d(GPT(CFG, seed=0), mesh=mesh)
    idx, targets = make_batch(CFG, 6, seed=1)
    loss_2p5d(model, idx, targets, Grid2p5D.from_mesh(mesh))


def test_a_batch_not_divisible_by_q_times_depth_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"batch=6 is not divisible by q\*depth = 2\*2 = 4"):
        run_threaded(TP, _odd_batch)
