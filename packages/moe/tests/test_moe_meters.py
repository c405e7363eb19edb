"""Tier 1: the bytes one expert-parallel call puts on the wire, against the theory.

Per rank, forward: the counts all-to-all (``E`` int64, less the ``E / ep`` it keeps), the
rows it sends to other ranks' experts, and the outputs it returns for the rows other ranks
sent it (``d`` floats each); backward: the same rows' gradients, the other way round. Rows
for a rank's own experts stay put.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import CommMeter
from tessera.comm.testing import run_threaded
from tessera.moe import MoE

D, EXPERTS = 4, 8


def _rank(rank: int, xs: list[Tensor]) -> dict[str, Any]:
    layer = MoE(D, 5, EXPERTS, top_k=2, capacity_factor=1.5, seed=3, ep_group=dist.group.WORLD)
    x = xs[rank].clone().requires_grad_()
    with CommMeter() as forward:
        y = layer(x)
    with CommMeter() as backward:
        y.sum().backward()
    return {"kept": layer.stats.kept, "forward": forward.sent_bytes, "backward": backward.sent_bytes}


@pytest.mark.parametrize("ep", [2, 4])
def test_an_expert_parallel_call_moves_the_rows_that_change_rank(ep: int) -> None:
    gen = torch.Generator().manual_seed(ep)
    xs = [torch.randn(6 + 3 * r, D, generator=gen) for r in range(ep)]
    runs = run_threaded(ep, _rank, xs)
    local = EXPERTS // ep
    to = [[int(run["kept"][j * local : (j + 1) * local].sum()) for j in range(ep)] for run in runs]
    for r, run in enumerate(runs):
        sent = sum(to[r][j] for j in range(ep) if j != r)
        served = sum(to[q][r] for q in range(ep) if q != r)
        rows = 4 * D * (sent + served)
        assert run["forward"] == 8 * (EXPERTS - local) + rows
        assert run["backward"] == rows
