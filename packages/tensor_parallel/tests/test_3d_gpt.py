"""Tier 1: the reference GPT under ``GPT_3D_PLAN`` on a 2 x 2 x 2 cube (tp=8, threaded ranks)
equals the serial GPT: every parameter gradient of the first step, gathered from the eight
ranks by the shard specs ``parallelize`` recorded (consolidation's path: all-gather over tp,
``unshard`` in tp-rank order), and the loss curve and weights of a few SGD steps; with the
token embedding split on the hidden (``GPT_3D_PLAN``) or the vocabulary too
(``GPT_3D_VOCAB_PLAN``). The same for 2 SGD steps on a 3 x 3 x 3 cube (tp=27) with a one-layer
GPT whose sizes q=3 divides (hidden 54 = 27 x 2, 6 heads, vocabulary 63, batch 9).

Tolerances (fp32): gradients ``rtol=1e-4``, ``atol=1e-5`` times the largest serial gradient
of that parameter (floored at 1e-2: some gradients, e.g. the key biases, are zero in exact
arithmetic and hold only round-off); losses ``rtol=1e-5``; the weights after the steps
``rtol=1e-5``, ``atol=1e-6`` (they are O(0.02-1) and move by lr times gradients that agree
to the bound above). The 3D model adds the same products in another order (partial matmuls
summed by reduce-scatters, per-line partial norms, weight gradients reduce-scattered over
batch blocks) through two layers, attention and the loss, a few ulps per layer.
"""

from __future__ import annotations

import pytest
from torch import Tensor

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import parallelize, shard_specs
from tessera.tensor_parallel.testing import Curve, assert_follows_serial, gather_by_specs, sgd_curve
from tessera.tensor_parallel.three_d import (
    GPT_3D_PLAN,
    GPT_3D_VOCAB_PLAN,
    Cube3D,
    CubeShardSpec,
    loss_3d,
    parallelize_3d,
)

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
CFG_Q3 = GPTConfig(vocab_size=63, seq_len=4, d_model=54, n_heads=6, n_layers=1)
STEPS, LR, BATCH, TP = 4, 0.5, 8, 8


def _serial(cfg: GPTConfig = CFG, batch: int = BATCH, steps: int = STEPS) -> Curve:
    idx, targets = make_batch(cfg, batch, seed=1)
    return sgd_curve(GPT(cfg, seed=0), lambda m: m.loss(idx, targets), steps=steps, lr=LR)


Out = tuple[Curve, dict[str, CubeShardSpec], dict[str, Tensor]]


def _parallel(rank: int, how: str) -> Out:
    mesh = Mesh(Topology(tp=TP, tp_mode=TPMode.THREE_D))
    cube = Cube3D.from_mesh(mesh)
    if how == "parallelize_3d":
        model = parallelize_3d(GPT(CFG, seed=0), mesh=mesh)
    else:  # plain parallelize: the styles find the cube in the 3d mesh
        plan = GPT_3D_VOCAB_PLAN if how == "vocab" else GPT_3D_PLAN
        model = parallelize(GPT(CFG, seed=0), plan=plan, mesh=mesh)
    idx, targets = make_batch(CFG, BATCH, seed=1)  # the global batch; loss_3d takes this rank's block
    curve = sgd_curve(model, lambda m: loss_3d(m, idx, targets, cube), steps=STEPS, lr=LR)
    specs = {n: s for n, s in shard_specs(model).items() if isinstance(s, CubeShardSpec)}
    return curve, specs, gather_by_specs(model, curve[2], mesh.group("tp"), TP)


@pytest.mark.parametrize("how", ["parallelize_3d", "by-name", "vocab"])
def test_gpt_3d_gradients_and_sgd_loss_curve_equal_serial(how: str) -> None:
    serial = _serial()
    out = run_threaded(TP, _parallel, how)
    assert_follows_serial(serial, [(curve, full) for curve, _, full in out], out[0][1])


def _parallel_q3(rank: int) -> Out:
    mesh = Mesh(Topology(tp=27, tp_mode=TPMode.THREE_D))
    cube = Cube3D.from_mesh(mesh)
    model = parallelize_3d(GPT(CFG_Q3, seed=0), mesh=mesh)
    idx, targets = make_batch(CFG_Q3, 9, seed=1)
    curve = sgd_curve(model, lambda m: loss_3d(m, idx, targets, cube), steps=2, lr=LR)
    specs = {n: s for n, s in shard_specs(model).items() if isinstance(s, CubeShardSpec)}
    return curve, specs, gather_by_specs(model, curve[2], mesh.group("tp"), 27)


def test_gpt_3d_on_a_3x3x3_cube_follows_serial() -> None:
    serial = _serial(CFG_Q3, 9, 2)
    out = run_threaded(27, _parallel_q3)
    assert_follows_serial(serial, [(curve, full) for curve, _, full in out], out[0][1])


def _one_d_mesh(rank: int) -> None:
    parallelize(GPT(CFG, seed=0), plan=GPT_3D_PLAN, mesh=Mesh(Topology(tp=8)))


def test_the_3d_plan_over_a_1d_mesh_says_it_needs_a_3d_one() -> None:
    with pytest.raises(ValueError, match=r"tp_mode='3d'.*tp=8 tp_mode=1d"):
        run_threaded(TP, _one_d_mesh)


def _not_a_cube(rank: int) -> None:
    parallelize(GPT(CFG, seed=0), plan=GPT_3D_PLAN, mesh=Mesh(Topology(tp=4)))


def test_the_3d_plan_over_tp_4_says_4_is_not_a_cube() -> None:
    with pytest.raises(ValueError, match=r"tp=4 is not a cube"):
        run_threaded(4, _not_a_cube)
