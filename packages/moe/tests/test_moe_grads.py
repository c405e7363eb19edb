"""Tier 1: `reduce_gradients` under expert x data parallelism gives every rank the gradient
of the mean loss over all ranks' tokens, against one serial layer run on every shard.

Ranks (threads) ``0..W-1`` form ep groups of consecutive ranks and expert-data-parallel
groups of the ranks at the same place in theirs. Tolerance: fp32 rtol 1e-5, atol 1e-5, as
for the parameter gradients of ``test_moe_ep.py`` (sums over at most 40 rows, in another
order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm.testing import run_threaded
from tessera.moe import MoE, expert_parameters, reduce_gradients

TOL = {"rtol": 1e-5, "atol": 1e-5}
CONFIG: dict[str, Any] = {
    "d_model": 4,
    "hidden": 6,
    "experts": 4,
    "top_k": 2,
    "capacity_factor": 1.0,
    "shared_hidden": 3,
    "seed": 9,
}


def shards(world: int) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(5 + r, CONFIG["d_model"], generator=gen) for r in range(world)]
    return xs, [torch.randn(x.shape, generator=gen) for x in xs]


def loss(layer: MoE, x: Tensor, g: Tensor) -> Tensor:
    return (layer(x) * g).sum() + 0.1 * layer.aux_loss + 0.01 * layer.z_loss


def _rank(rank: int, world: int, ep: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    edp_groups = [dist.new_group(list(range(p, world, ep))) for p in range(ep)]
    layer = MoE(**CONFIG, ep_group=ep_groups[rank // ep])
    loss(layer, xs[rank], gs[rank]).backward()
    reduce_gradients(layer, data_group=None, expert_data_group=edp_groups[rank % ep])
    return {"first": layer.first_expert, "grads": {n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2), (4, 4)])
def test_reduced_gradients_are_those_of_the_mean_loss(world: int, ep: int) -> None:
    xs, gs = shards(world)
    serial = MoE(**CONFIG)
    for x, g in zip(xs, gs, strict=True):
        (loss(serial, x, g) / world).backward()
    want = {n: p.grad for n, p in serial.named_parameters()}
    local = CONFIG["experts"] // ep
    for rank, run in enumerate(run_threaded(world, _rank, world, ep, xs, gs, timeout=60)):
        start = run["first"]
        for name, got in run["grads"].items():
            ref = want[name]
            assert ref is not None
            if name.startswith("experts."):
                ref = ref[start : start + local]
            torch.testing.assert_close(got, ref, **TOL, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def test_expert_parameters_are_the_banks_only() -> None:
    model = torch.nn.Sequential(MoE(**CONFIG), torch.nn.Linear(4, 4), MoE(**{**CONFIG, "seed": 1}))
    got = {id(p) for p in expert_parameters(model)}
    want = {id(p) for i in (0, 2) for p in model[i].experts.parameters()}
    assert got == want and len(want) == 6
