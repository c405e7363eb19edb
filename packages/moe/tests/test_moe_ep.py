"""Tiers 1 and 2: expert parallelism against the serial layer on each rank's tokens.

Each rank holds its own tokens. The reference is one serial layer (same seed) run on every
rank's shard in turn, accumulating the gradients of the sum of the ranks' losses (each a
random projection of the output plus the weighted auxiliary and z losses). Rank r must
match the serial call on shard r in output, input gradient, losses and routing counts;
the sum over ranks of the router's and the shared expert's gradients must match the
serial ones; the owner of each expert must hold the serial layer's weights and gradient
for it. Hypothesis draws ep (2, 4), experts per rank, top-k, capacity or drop-less, tokens
per rank (zero included) and the routing case: random, skewed towards low experts, every
token to one expert, only the first top_k experts used (the others empty, at ep = 4 whole
ranks without work).

Tolerances, fp32: outputs and input gradients rtol 1e-5, atol 1e-6 (the owner's batched
matmul holds other ranks' rows too, so only the blocking of a dot product of at most 8
terms of order 1 may differ); parameter gradients rtol 1e-5, atol 1e-5 (sums over up to
32 rows, in another order: per rank and then across ranks, against one rank after
another).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm.testing import run_threaded
from tessera.comm.testing.fixtures import PoolFactory
from tessera.moe import MoE, shard_experts

OUT = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-5, "atol": 1e-5}
CASES = ("random", "skewed", "one", "empty")
DENSE = ("router.weight", "shared.w1", "shared.w2", "shared.w3")


def router_weight(case: str, experts: int, d: int, top_k: int, seed: int) -> Tensor:
    """A router for the case; inputs are ``1 + 0.3 * noise``, so ``x @ ones / d`` is near 1."""
    w = torch.randn(experts, d, generator=torch.Generator().manual_seed(seed)) * 0.5
    lean = torch.ones(d) / d
    if case == "skewed":
        w += torch.linspace(3.0, 0.0, experts)[:, None] * lean
    elif case == "one":
        w = w * 0.01
        w[-1] += 20.0 * lean
    elif case == "empty":
        w[top_k:] -= 20.0 * lean
    return w


def inputs(tokens: list[int], d: int, seed: int) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [1.0 + 0.3 * torch.randn(t, d, generator=gen) for t in tokens]
    return xs, [torch.randn(t, d, generator=gen) for t in tokens]


def build(config: dict[str, Any], router: Tensor, group: dist.ProcessGroup | None, via: str) -> MoE:
    if group is not None and via == "ep_group":
        layer = MoE(**config, ep_group=group)
    else:
        layer = MoE(**config)
        if group is not None:
            shard_experts(layer, group)
    with torch.no_grad():
        layer.router.weight.copy_(router)
    return layer


def step(layer: MoE, x: Tensor, g: Tensor, needs_grad: bool = True) -> dict[str, Any]:
    """One forward and backward; the layer's outputs, losses and routing counts."""
    x = x.clone().requires_grad_(needs_grad)
    y = layer(x)
    ((y * g).sum() + 0.1 * layer.aux_loss + 0.01 * layer.z_loss).backward()
    return {
        "y": y.detach(),
        "dx": None if x.grad is None else x.grad,
        "aux": layer.aux_loss.detach(),
        "z": layer.z_loss.detach(),
        "routed": layer.stats.routed,
        "kept": layer.stats.kept,
    }


def _ep_rank(
    rank: int,
    config: dict[str, Any],
    router: Tensor,
    xs: list[Tensor],
    gs: list[Tensor],
    via: str,
    frozen: int,
) -> dict[str, Any]:
    layer = build(config, router, dist.group.WORLD, via)
    out = step(layer, xs[rank], gs[rank], needs_grad=rank != frozen)
    out["params"] = {n: p.detach().clone() for n, p in layer.named_parameters()}
    out["grads"] = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    out["first"] = layer.first_expert
    return out


def check(
    config: dict[str, Any],
    router: Tensor,
    xs: list[Tensor],
    gs: list[Tensor],
    runs: list[Any],
    frozen: int = -1,
) -> None:
    serial = build(config, router, None, "serial")
    want = [step(serial, x, g, needs_grad=r != frozen) for r, (x, g) in enumerate(zip(xs, gs, strict=True))]
    ep = len(runs)
    for r, (got, exp) in enumerate(zip(runs, want, strict=True)):
        for key in ("y", "dx", "aux", "z"):
            if exp[key] is None:
                assert got[key] is None
                continue
            tol = OUT if key in ("y", "dx") else GRAD
            torch.testing.assert_close(
                got[key], exp[key], **tol, msg=lambda m, k=key, r=r: f"rank {r} {k}: {m}"
            )
        assert torch.equal(got["routed"], exp["routed"]) and torch.equal(got["kept"], exp["kept"])
    serial_params = dict(serial.named_parameters())
    for name in DENSE:
        if name in serial_params:
            assert serial_params[name].grad is not None
            total = sum(run["grads"][name] for run in runs)
            torch.testing.assert_close(
                total, serial_params[name].grad, **GRAD, msg=lambda m, n=name: f"{n}: {m}"
            )
    local = config["experts"] // ep
    for r, run in enumerate(runs):
        start = run["first"]
        assert start == r * local
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            if name not in serial_params:
                continue
            p = serial_params[name]
            assert torch.equal(run["params"][name], p.detach()[start : start + local])
            assert p.grad is not None
            torch.testing.assert_close(
                run["grads"][name],
                p.grad[start : start + local],
                **GRAD,
                msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}",
            )


@st.composite
def ep_cases(draw: st.DrawFn) -> tuple[dict[str, Any], str, list[int], int, str]:
    ep = draw(st.sampled_from([2, 4]))
    experts = ep * draw(st.integers(1, 3))
    top_k = draw(st.integers(1, min(experts, 3)))
    config = {
        "d_model": draw(st.sampled_from([4, 8])),
        "hidden": draw(st.integers(1, 8)),
        "experts": experts,
        "top_k": top_k,
        "activation": draw(st.sampled_from(["swiglu", "gelu"])),
        "capacity_factor": draw(st.sampled_from([None, 0.5, 1.0, 2.0])),
        "renormalize": draw(st.booleans()),
        "shared_hidden": draw(st.sampled_from([None, 3])),
        "seed": draw(st.integers(0, 2**31)),
    }
    tokens = draw(st.lists(st.integers(0, 8), min_size=ep, max_size=ep))
    return (
        config,
        draw(st.sampled_from(CASES)),
        tokens,
        draw(st.integers(0, 2**31)),
        draw(st.sampled_from(["ep_group", "shard_experts"])),
    )


@settings(max_examples=60)
@given(ep_cases())
def test_expert_parallel_equals_the_serial_layer_on_each_shard(
    case: tuple[dict[str, Any], str, list[int], int, str],
) -> None:
    config, routing, tokens, seed, via = case
    router = router_weight(routing, config["experts"], config["d_model"], config["top_k"], seed)
    xs, gs = inputs(tokens, config["d_model"], seed)
    runs = run_threaded(len(tokens), _ep_rank, config, router, xs, gs, via, -1, timeout=60)
    check(config, router, xs, gs, runs)
    if routing == "one":  # the case routes as it says: every token's first choice is the last expert
        for run, t in zip(runs, tokens, strict=True):
            assert int(run["routed"][-1]) == t


def test_a_rank_whose_input_needs_no_gradient_still_passes_the_others_back() -> None:
    config = {"d_model": 4, "hidden": 5, "experts": 4, "top_k": 2, "seed": 7, "capacity_factor": 1.0}
    router = router_weight("random", 4, 4, 2, 3)
    xs, gs = inputs([6, 5], 4, 11)
    check(
        config,
        router,
        xs,
        gs,
        run_threaded(2, _ep_rank, config, router, xs, gs, "ep_group", 1, timeout=60),
        1,
    )


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_expert_parallel_on_gloo_processes(worker_pools: PoolFactory, transport: str) -> None:
    config = {
        "d_model": 4,
        "hidden": 6,
        "experts": 4,
        "top_k": 2,
        "seed": 5,
        "capacity_factor": 1.0,
        "shared_hidden": 3,
    }
    router = router_weight("skewed", 4, 4, 2, 1)
    xs, gs = inputs([7, 0], 4, 2)  # rank 1 has no tokens but serves two experts
    env = {"TESSERA_SHM": "1" if transport == "shm" else "0"}
    check(
        config, router, xs, gs, worker_pools(2).run(_ep_rank, config, router, xs, gs, "ep_group", -1, env=env)
    )


def _refuse(rank: int, via: str) -> None:
    config = {"d_model": 4, "hidden": 4, "experts": 6, "top_k": 2, "seed": 0}
    build(config, torch.zeros(6, 4), dist.group.WORLD, via)


@pytest.mark.parametrize("via", ["ep_group", "shard_experts"])
def test_experts_not_divisible_by_ep_are_refused(via: str) -> None:
    with pytest.raises(ValueError, match=r"experts \(6\) must be divisible by the ep group's size \(4\)"):
        run_threaded(4, _refuse, via)


def _unseeded(rank: int) -> None:
    MoE(4, 4, 2, ep_group=dist.group.WORLD)


def test_an_ep_group_without_a_seed_is_refused() -> None:
    with pytest.raises(ValueError, match="an ep_group needs an explicit seed"):
        run_threaded(2, _unseeded)
