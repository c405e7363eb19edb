"""Faults: a corrupt or foreign engine checkpoint raises on every rank, none hangs.

Real gloo processes (the worker pool): after a save, one rank's file is damaged; loading
must raise on every rank (the damaged rank its own checksum error, the others a
`RemoteFailure`) before any collective, so the pool's next example still runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.comm.testing import GPT, GPTConfig, make_batch
from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, Engine, ParallelConfig, ZeroConfig, boost

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)


def _engine(config: Config) -> Engine:
    model = GPT(GPT_CFG, seed=1)
    return boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _config(dp: int, tp: int, zero: int) -> Config:
    c = Config(parallel=ParallelConfig(dp=dp, tp=tp, microbatches=1), zero=ZeroConfig(stage=zero))
    return dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=4),
        model=dataclasses.replace(c.model, seq_len=8, d_model=16, n_heads=4, n_layers=2),
    )


def _damage_and_load(rank: int, path: str, damage: str) -> str:
    engine = _engine(_config(dp=2, tp=1, zero=1))
    engine.train_step(*make_batch(GPT_CFG, 4, seed=0))
    engine.save(path)
    if rank == 0:
        file = Path(path) / "rank-00001.safetensors"
        if damage == "flip":
            data = bytearray(file.read_bytes())
            data[-1] ^= 0xFF
            file.write_bytes(bytes(data))
        else:
            file.unlink()
    dist.barrier()
    fresh = _engine(_config(dp=2, tp=1, zero=1))
    try:
        fresh.load(path)
    except Exception as e:  # reported to the test, which checks every rank raised
        outcome = f"{type(e).__name__}: {e}"
    else:
        outcome = "loaded"
    # the pool's group still works: no rank is stuck in a collective
    fresh.train_step(*make_batch(GPT_CFG, 4, seed=1))
    engine.mesh.close()
    fresh.mesh.close()
    return outcome


def test_a_damaged_rank_file_raises_on_every_rank(worker_pools: PoolFactory, tmp_path: Path) -> None:
    for damage, own in (("flip", "does not match its checksum"), ("remove", "No such file")):
        path = str(tmp_path / damage)
        outcomes = worker_pools(2).run(_damage_and_load, path, damage, timeout=120)
        assert outcomes[0].startswith("RemoteFailure: reading the checkpoint"), outcomes
        assert own in outcomes[1], outcomes


def _load_other_layout(rank: int, path: str) -> str:
    saver = _engine(_config(dp=2, tp=2, zero=0))
    saver.save(path)
    saver.mesh.close()
    other = _engine(_config(dp=4, tp=1, zero=0))
    try:
        other.load(path)
    except ValueError as e:
        return str(e)
    finally:
        other.mesh.close()
    return "loaded"


def test_a_checkpoint_of_another_topology_is_refused_by_name(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    for message in worker_pools(4).run(_load_other_layout, str(tmp_path / "ckpt"), timeout=120):
        assert "'dp': 2" in message and "'dp': 4" in message, message
