"""Tier 1: under model parallelism the clipped norm is the whole model's, counted once.

Four thread ranks as dp=2 x mp=2. Each mp rank holds a different "sharded" parameter and an
identical copy of a "replicated" one (as tensor parallelism leaves a LayerNorm). The global
gradient norm is over both sharded halves and the replicated parameter once.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.clip import shard_weights
from tessera.zero.flat import FlatLayout


class Part(nn.Module):
    def __init__(self, sharded: Tensor, replicated: Tensor) -> None:
        super().__init__()
        self.sharded = nn.Parameter(sharded.clone())
        self.replicated = nn.Parameter(replicated.clone())

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.sharded).sum() + (x * self.replicated).sum() ** 2


def _rank(rank: int, stage: int, shards: list[Tensor], rep: Tensor, xs: list[Tensor]) -> float:
    mesh = Mesh(Topology(dp=2, tp=2))
    mp = mesh.coordinate("tp")
    model = Part(shards[mp], rep)
    zero = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        stage=stage,
        group=mesh.group("dp"),
        clip_grad_norm=1e9,
        norm_groups=[mesh.group("tp")],
        replication={model.replicated: 2},
    )
    zero.backward(model(xs[mesh.coordinate("dp")]))
    zero.step()
    assert zero.last_grad_norm is not None
    return zero.last_grad_norm


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=8)
@given(seed=st.integers(0, 2**20), n=st.integers(1, 7))
def test_norm_counts_replicated_parameters_once(stage: int, seed: int, n: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.randn(n, 3, generator=gen) for _ in range(2)]
    rep = torch.randn(n, generator=gen)
    xs = [torch.randn(4, n, generator=gen) for _ in range(2)]
    # serial: the dp-mean gradient of each mp rank's part
    sq = 0.0
    rep_grad = None
    for mp in range(2):
        grads = []
        for dp in range(2):
            model = Part(shards[mp], rep)
            model(xs[dp]).backward()
            grads.append((model.sharded.grad, model.replicated.grad))
        sq += float((sum(g[0] for g in grads) / 2).pow(2).sum())  # type: ignore[union-attr]
        rep_grad = sum(g[1] for g in grads) / 2  # type: ignore[operator]
    assert rep_grad is not None
    sq += float(rep_grad.pow(2).sum())
    norms = run_threaded(4, _rank, stage, shards, rep, xs)
    for norm in norms:
        assert math.isclose(norm, math.sqrt(sq), rel_tol=1e-5)


def test_shard_weights_cut_tensors_at_shard_edges() -> None:
    layout = FlatLayout((3, 4, 2), world_size=2)  # flat 9, shards of 5: [0,5) [5,10)
    assert shard_weights(layout, 0, [1.0, 0.5, 1.0]) == [(3, 5, 0.5)]
    assert shard_weights(layout, 1, [1.0, 0.5, 0.25]) == [(0, 2, 0.5), (2, 4, 0.25)]
