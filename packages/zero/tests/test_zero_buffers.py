"""Stages 1-2 reuse their flat gradient buffers from step to step (no new model-sized
allocation per step), and keep at most two of them.

Counts, not timings: every reduce-scatter's input storage is recorded (the module's
``reduce_scatter_async`` wrapped for the test). The values are checked against serial runs
by test_zero_threaded, whose multi-step examples run through the same reused buffers.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer, flat_param

_LOCK = threading.Lock()


def _steps(rank: int, stage: int, inputs: dict[tuple[int, int], set[int]], step_of: list[int]) -> int:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    zero = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01), stage=stage, bucket_bytes=600)
    for step in range(3):
        step_of[rank] = step
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        zero.backward(model(x).square().mean())
        zero.step()
    spare = zero.flats[0].spare_buffers
    assert spare is not None
    return len(spare)


@pytest.mark.parametrize("stage", [1, 2])
def test_flat_gradient_buffers_are_reused(stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 2 and 3 reduce-scatter out of the buffers step 1 allocated; at most two are kept."""
    inputs: dict[tuple[int, int], set[int]] = {}
    step_of = [0, 0]
    original = flat_param.reduce_scatter_async

    def recording(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        rank = dist.get_rank()
        with _LOCK:
            inputs.setdefault((rank, step_of[rank]), set()).add(x.untyped_storage().data_ptr())
        return original(x, *args, **kwargs)

    monkeypatch.setattr(flat_param, "reduce_scatter_async", recording)
    kept = run_threaded(2, _steps, stage, inputs, step_of)
    for rank in range(2):
        first = inputs[(rank, 0)]
        assert 1 <= len(first) <= 2
        assert inputs[(rank, 1)] <= first
        assert inputs[(rank, 2)] <= first
        assert 1 <= kept[rank] <= 2
