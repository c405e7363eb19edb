"""Tier 2 (the worker pool): the main job's mixture-of-experts GPT (``moe_model.moe_gpt``,
capacity 1.0 so tokens drop, router losses attached inside the layers) trains through
``boost()`` with its spec (``MOE_GPT_SPEC``) at dp=2 with 2 microbatches, ZeRO 1 and 3, at
tp=2 (every expert's hidden units split, the ``moe`` style), with Megatron SP, and at dp=2 x
ep=2 x tp=2 with SP under ZeRO-3, as the serial model trains when it runs the same
``dp * microbatches`` chunks one after the other with the losses' backward
scale ``1 / chunks`` (``set_aux_grad_scale``; the engine's ranks use ``loss_scale /
microbatches`` and the data-parallel mean does the rest).

Capacity and the balancing loss are per call, so the chunks are the oracle's unit: rank ``r``
trains rows ``r * B / dp ...``, each split into microbatches in order. Bounds as in
``test_user_models.py``: losses rel 1e-5, SGD weights rtol 1e-5, atol 1e-6. An unscaled
attachment (scale 1 per chunk instead of 1 / chunks) moves the routers by 4x the losses'
share, far outside them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, MoEConfig, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.job.moe_model import MOE_GPT_SPEC, moe_gpt
from tessera.launcher.testing import serial_run, sgd
from tessera.models import GPT, GPTConfig
from tessera.moe import set_aux_grad_scale

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, mlp_ratio=2)
MOE = MoEConfig(enabled=True, experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.5, z_loss_coef=0.05)
BATCH, STEPS, LR, DP, MICRO = 8, 3, 0.3, 2, 2

Run = tuple[list[float], dict[str, Tensor]]


def _build(frozen: bool = False) -> GPT:
    model = moe_gpt(CFG, MOE, seed=7)
    for name in ("layers.0.mlp.experts", "layers.1.mlp.router") if frozen else ():  # fine-tuning
        model.get_submodule(name).requires_grad_(False)
    return model


def _batch(step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(
        0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _serial(chunks: int, frozen: bool) -> Run:
    return serial_run(_build(frozen), [_batch(step) for step in range(STEPS)], sgd(LR), chunks=chunks)


def _parallel(rank: int, config: Config, frozen: bool) -> Run:
    model = _build(frozen)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = boost(model, opt, config, spec=MOE_GPT_SPEC)
    losses = []
    for step in range(STEPS):
        set_aux_grad_scale(engine.module, engine.zero.loss_scale / config.parallel.microbatches)
        losses.append(engine.train_step(*_batch(step)).loss)
    weights = engine.full_state_dict()
    engine.mesh.close()
    return losses, weights


@pytest.mark.parametrize(
    ("parallel", "zero", "frozen"),
    [
        (ParallelConfig(dp=DP, microbatches=MICRO), 1, False),
        (ParallelConfig(dp=DP, microbatches=MICRO), 3, False),
        (ParallelConfig(tp=2, microbatches=MICRO), 1, False),  # MOE_GPT_PLAN: attention and experts split
        (ParallelConfig(tp=2, sequence_parallel=True, microbatches=MICRO), 1, False),
        (ParallelConfig(dp=DP, ep=2, tp=2, sequence_parallel=True, microbatches=MICRO), 3, False),
        # one layer's expert bank (sharded over ep) and the other's router frozen
        (ParallelConfig(dp=DP, ep=2, tp=2, sequence_parallel=True, microbatches=MICRO), 3, True),
        # 2D and 3D: each mixture gathers the grid's blocks of its input, experts split over all tp
        (ParallelConfig(dp=DP, ep=2, tp=4, tp_mode="2d", microbatches=MICRO), 1, False),
        (ParallelConfig(tp=8, tp_mode="3d", microbatches=1), 3, False),
    ],
    ids=[
        "dp2-zero1",
        "dp2-zero3",
        "tp2-zero1",
        "tp2-sp-zero1",
        "dp2-ep2-tp2-sp-zero3",
        "frozen-dp2-ep2-tp2-sp-zero3",
        "dp2-ep2-2d-zero1",
        "3d-zero3",
    ],
)
def test_the_moe_gpt_trains_through_boost_as_its_serial_chunks(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int, frozen: bool
) -> None:
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision="fp32"), moe=MOE)
    config = dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))
    assert config.validate() == []
    results = worker_pools(config.world_size).run(_parallel, config, frozen, timeout=180)
    losses, weights = _serial(parallel.dp * parallel.microbatches, frozen)
    for curve, part in results:
        assert curve == pytest.approx(losses, rel=1e-5)
        torch.testing.assert_close(part, weights, rtol=1e-5, atol=1e-6)
