"""Integration: boost() composing dp x pp x tp x ZeRO equals the serial GPT, step by step.

Every rank gets the same global batch; the serial model trains on it with the same
optimizer, clipping and data. Each composition runs a few AdamW steps on the worker pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.comm.testing import GPT, GPTConfig, make_batch
from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config
from tessera.launcher.boost import boost
from tessera.launcher.config import ParallelConfig, TrainConfig, ZeroConfig

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
STEPS = 4
BATCH = 8


def _config(parallel: ParallelConfig, zero: int, precision: str = "fp32") -> Config:
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision=precision))
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, batch_size=BATCH))
    return dataclasses.replace(
        c,
        model=dataclasses.replace(c.model, seq_len=GPT_CFG.seq_len, d_model=16, n_heads=4, n_layers=2),
        optim=dataclasses.replace(c.optim, lr=1e-2, clip_grad_norm=0.05, weight_decay=0.1),
    )


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _serial() -> list[tuple[float, float]]:
    model = GPT(GPT_CFG, seed=1)
    opt = _optimizer(model)
    out = []
    for step in range(STEPS):
        idx, targets = make_batch(GPT_CFG, BATCH, seed=step)
        loss = model.loss(idx, targets)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        out.append((loss.item(), float(norm)))
    return out


def _parallel(rank: int, config: Config) -> list[tuple[float, float]]:
    model = GPT(GPT_CFG, seed=1)
    engine = boost(model, _optimizer(model), config)
    out = []
    for step in range(STEPS):
        idx, targets = make_batch(GPT_CFG, BATCH, seed=step)
        result = engine.train_step(idx, targets)
        assert result.grad_norm is not None
        out.append((result.loss, result.grad_norm))
    engine.mesh.close()
    return out


def _check(parallel: list[tuple[float, float]], serial: list[tuple[float, float]]) -> None:
    """Losses and global gradient norms (before clipping) equal the serial ones."""
    assert [loss for loss, _ in parallel] == pytest.approx([loss for loss, _ in serial], rel=1e-5)
    assert [norm for _, norm in parallel] == pytest.approx([norm for _, norm in serial], rel=1e-4)


CASES = [
    (ParallelConfig(dp=2, tp=2, microbatches=2), 0),
    (ParallelConfig(dp=2, tp=2, sequence_parallel=True, microbatches=2), 1),
    (ParallelConfig(dp=2, tp=2, microbatches=2), 2),
    (ParallelConfig(dp=2, tp=2, microbatches=1), 3),
    (ParallelConfig(pp=2, tp=2, microbatches=4, schedule="1f1b"), 0),
    (ParallelConfig(dp=2, pp=2, microbatches=2, schedule="zb-h1"), 1),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True, microbatches=2, schedule="1f1b"), 1),
    (ParallelConfig(pp=2, tp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2), 1),
]


@pytest.mark.parametrize(
    ("parallel", "zero"),
    CASES,
    ids=lambda c: (
        str(c)
        if isinstance(c, int)
        else f"dp{c.dp}-pp{c.pp}-tp{c.tp}{'-sp' if c.sequence_parallel else ''}-{c.schedule}"
    ),
)
def test_composition_follows_the_serial_loss_curve(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int
) -> None:
    config = _config(parallel, zero)
    assert config.validate() == []
    serial = _serial()
    for result in worker_pools(config.world_size).run(_parallel, config, timeout=120):
        _check(result, serial)


def test_dp_pp_tp_with_zero_on_eight_ranks(worker_pools: PoolFactory) -> None:
    config = _config(ParallelConfig(dp=2, pp=2, tp=2, microbatches=2, schedule="1f1b"), 1)
    serial = _serial()
    for result in worker_pools(8).run(_parallel, config, timeout=180):
        _check(result, serial)


def _resume(rank: int, config: Config, path: str) -> tuple[list[float], list[float]]:
    """Five steps straight, and two steps + save + a new engine that loads and runs three more."""

    def fresh() -> Any:
        model = GPT(GPT_CFG, seed=1)
        opt = _optimizer(model)
        return boost(
            model,
            opt,
            config,
            scheduler_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
        )

    straight = fresh()
    a = [straight.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(5)]
    first = fresh()
    b = [first.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(2)]
    first.save(path)
    second = fresh()
    second.load(path)
    assert second.step == 2
    b += [second.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(second.step, 5)]
    return a, b


@pytest.mark.parametrize(
    ("parallel", "zero"),
    [
        (ParallelConfig(dp=2, tp=2, microbatches=2), 1),
        (ParallelConfig(pp=2, tp=2, microbatches=2), 0),
        (ParallelConfig(dp=4, microbatches=2), 3),
    ],
    ids=["dp2-tp2-zero1", "pp2-tp2", "dp4-zero3"],
)
def test_resume_continues_the_exact_loss_curve(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig, zero: int
) -> None:
    config = _config(parallel, zero)
    for straight, resumed in worker_pools(4).run(_resume, config, str(tmp_path / "ckpt"), timeout=180):
        assert resumed == straight  # bit for bit
