"""The planner's operator counts (`tessera.planner.operators`) against what the runtime launches.

Each mode's reference GPT (the size `hatch run bench plan` measures: ring attention launches
fewer operators on shorter sequences) is built by ``boost()`` on a pool of gloo processes
(shared-memory collectives, as a job runs them) with one and with two layers; a ``TorchDispatchMode`` counts
the operators rank 0 dispatches in one training step (forward, backward, SGD step) after a
first step. The second layer's count is one layer's; the one-layer model less that is the
rest (embedding, head and loss, optimizer). Both, over the serial model's, must match the
planner's ratios within 10% (its tables are rounded to two digits and the counts move a
little with the code; a ratio off by more misprices every launch-bound prediction of that
mode by as much).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.comm.testing import WorkerPool
from tessera.launcher import boost
from tessera.launcher.config import Config, DataConfig, ModelConfig, ParallelConfig, ZeroConfig
from tessera.launcher.config.auto import layout_of
from tessera.models import GPT, GPTConfig, make_batch
from tessera.planner.operators import OPS_EDGE, OPS_LAYER, operators

MODES: dict[str, dict[str, Any]] = {
    "1d": {"tp": 2},
    "1d+sp": {"tp": 2, "sequence_parallel": True},
    "ring": {"cp": 2},
    "ulysses": {"cp": 2, "cp_mode": "ulysses"},
    "2d": {"tp": 4, "tp_mode": "2d"},
    "2.5d": {"tp": 8, "tp_mode": "2.5d", "tp_depth": 2},
    "3d": {"tp": 8, "tp_mode": "3d"},
}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _config(parallel: dict[str, Any], layers: int) -> Config:
    return Config(
        parallel=ParallelConfig(**{"microbatches": 1, **parallel}),
        zero=ZeroConfig(0, False),
        model=ModelConfig(vocab_size=256, seq_len=64, d_model=256, n_heads=8, n_layers=layers),
        data=DataConfig(batch_size=16),
    )


def _count(rank: int, config: Config) -> int:
    """Operators this rank dispatches in its second training step."""
    m = config.model
    cfg = GPTConfig(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_layers, m.mlp_ratio, m.dropout, True)
    model = GPT(cfg, seed=0)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=1e-3), config)
    batch = make_batch(cfg, config.data.batch_size, seed=0)
    engine.train_step(*batch)
    count = _Count()
    with count:
        engine.train_step(*batch)
    engine.mesh.close()
    return count.n


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, WorkerPool]]:
    started: dict[int, WorkerPool] = {}
    yield started
    for pool in started.values():
        pool.close()


def _layer_and_rest(pools: dict[int, WorkerPool], parallel: dict[str, Any]) -> tuple[int, int]:
    one, two = _config(parallel, 1), _config(parallel, 2)
    world = one.world_size
    if world not in pools:
        pools[world] = WorkerPool(world, timeout=300)
    n1 = pools[world].run(_count, one)[0]
    n2 = pools[world].run(_count, two)[0]
    return n2 - n1, 2 * n1 - n2


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_planner_counts_the_operators_each_mode_launches(pools: dict[int, WorkerPool], mode: str) -> None:
    serial_layer, serial_rest = _layer_and_rest(pools, {})
    layer, rest = _layer_and_rest(pools, MODES[mode])
    config = _config(MODES[mode], 2)
    assert config.validate() == []
    ops_layer, ops_edge = operators(layout_of(config))
    counted, planned = layer / serial_layer, ops_layer / OPS_LAYER
    assert counted == pytest.approx(planned, rel=0.10), (
        f"{mode}: a layer launches {layer} operators, {counted:.2f}x the serial {serial_layer}; "
        f"the planner says {planned:.2f}x"
    )
    counted, planned = rest / serial_rest, ops_edge / OPS_EDGE
    assert counted == pytest.approx(planned, rel=0.10), (
        f"{mode}: the rest launches {rest} operators, {counted:.2f}x the serial {serial_rest}; "
        f"the planner says {planned:.2f}x"
    )
