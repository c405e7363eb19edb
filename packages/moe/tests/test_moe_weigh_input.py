"""Tiers 0 and 1: ``MoE(weigh="input")`` (Llama 4's experts: ``expert(w * x)``), serial against
a plain-torch reference, expert-parallel over ep=2 and split inside over tp=2 against the
serial layer.

The reference routes as Llama 4 does (top-k of the logits, the weights ``sigmoid(logit)``,
not renormalised), keeps each expert's first ``capacity`` assignments in token order, and
runs every kept assignment through its expert one row at a time, its input scaled by its
weight; a shared expert adds ``mlp(x)``. The router's weights are drawn large, so the weights
are far from 0 and 1, and an input-weighted expert differs from an output-weighted one at
order 1e-1 (which the first test checks too).

Tolerances, fp32: rtol 1e-5, atol 1e-6 for outputs and input gradients, atol 1e-5 for
parameter gradients: the same products, but batched (and under ep exchanged, under tp summed
over two halves of the hidden units) against one row at a time, so only the summation order
differs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tessera.comm.testing import run_threaded
from tessera.moe import MoE, RouterSpec, shard_experts, split_hidden

OUT = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-5, "atol": 1e-5}
LLAMA4 = {"renormalize": False, "routing": RouterSpec(score="sigmoid"), "weigh": "input"}


def _layer(config: dict[str, Any]) -> MoE:
    layer = MoE(**config, **LLAMA4)
    with torch.no_grad():  # logits of order 1: weights well inside (0, 1)
        layer.router.weight.mul_(4.0)
    return layer


def _mlp(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None) -> Tensor:
    return (F.silu(x @ w1) * (x @ w3) if w3 is not None else F.gelu(x @ w1)) @ w2


def _reference(layer: MoE, x: Tensor) -> Tensor:
    """Llama 4's mixture, one assignment at a time, with ``layer``'s weights."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.t()
    top, choices = torch.topk(logits, layer.top_k, dim=-1)
    weights = torch.sigmoid(top)
    t, e = tokens.shape[0], layer.num_experts
    factor = layer.capacity_factor
    cap = t * layer.top_k if factor is None else math.ceil(factor * t * layer.top_k / e)
    bank = layer.experts
    seen = [0] * e
    rows = []
    for i in range(t):
        row = tokens.new_zeros(tokens.shape[1])
        for k in range(layer.top_k):
            c = int(choices[i, k])
            seen[c] += 1
            if seen[c] <= cap:
                w3 = None if bank.w3 is None else bank.w3[c]
                row = row + _mlp(weights[i, k] * tokens[i], bank.w1[c], bank.w2[c], w3)
        if layer.shared is not None:
            shared = layer.shared
            row = row + _mlp(
                tokens[i], shared.w1[0], shared.w2[0], None if shared.w3 is None else shared.w3[0]
            )
        rows.append(row)
    return torch.stack(rows).view(x.shape)


def _step(layer: MoE, x: Tensor, g: Tensor, reference: bool = False) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    y = _reference(layer, x) if reference else layer(x)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return {"y": y.detach(), "dx": x.grad, "grads": grads}


def _data(tokens: int, d: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen)


CONFIGS = [
    {"d_model": 8, "hidden": 6, "experts": 4, "top_k": 1, "shared_hidden": 4, "seed": 1},
    {"d_model": 8, "hidden": 4, "experts": 4, "top_k": 2, "activation": "gelu", "seed": 2},
    {"d_model": 8, "hidden": 6, "experts": 4, "top_k": 2, "capacity_factor": 0.5, "seed": 3},
]


@pytest.mark.parametrize("config", CONFIGS, ids=["top1-shared", "top2-gelu", "top2-capacity"])
def test_input_weighted_experts_equal_the_reference(config: dict[str, Any]) -> None:
    layer = _layer(config)
    x, g = _data(12, 8, 5)
    got, want = _step(layer, x, g), _step(layer, x, g, reference=True)
    torch.testing.assert_close(got["y"], want["y"], **OUT)
    torch.testing.assert_close(got["dx"], want["dx"], **OUT)
    assert got["grads"].keys() == want["grads"].keys() and "router.weight" in got["grads"]
    torch.testing.assert_close(got["grads"], want["grads"], **GRAD)
    if config.get("capacity_factor"):
        assert layer.stats.dropped_fraction > 0  # the capacity does drop
    layer.weigh = "output"  # the choice matters: weighing outputs is another function
    assert (layer(x) - got["y"]).abs().max() > 1e-2


def test_an_unknown_weigh_is_refused() -> None:
    with pytest.raises(ValueError, match=r"weigh must be one of \('output', 'input'\), got 'both'"):
        MoE(4, 4, 2, weigh="both", seed=0)  # type: ignore[arg-type]


def _ep_rank(rank: int, config: dict[str, Any], xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    layer = shard_experts(_layer(config), dist.group.WORLD)
    return _step(layer, xs[rank], gs[rank])


def test_input_weighted_experts_at_ep2_equal_the_serial_layer_on_each_shard() -> None:
    config = {"d_model": 8, "hidden": 6, "experts": 4, "top_k": 2, "shared_hidden": 4, "seed": 4}
    config["capacity_factor"] = 1.0
    (x0, g0), (x1, g1) = _data(10, 8, 6), _data(7, 8, 7)
    runs = run_threaded(2, _ep_rank, config, [x0, x1], [g0, g1], timeout=60)
    serial = _layer(config)
    want = [_step(serial, x, g) for x, g in ((x0, g0), (x1, g1))]
    for got, exp in zip(runs, want, strict=True):
        torch.testing.assert_close(got["y"], exp["y"], **OUT)
        torch.testing.assert_close(got["dx"], exp["dx"], **OUT)
    for name in ("router.weight", "shared.w1", "shared.w2", "shared.w3"):  # replicated: summed over ep
        total = runs[0]["grads"][name] + runs[1]["grads"][name]
        torch.testing.assert_close(total, want[0]["grads"][name] + want[1]["grads"][name], **GRAD)
    for r, run in enumerate(runs):  # each rank's two experts
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            whole = want[0]["grads"][name] + want[1]["grads"][name]
            torch.testing.assert_close(run["grads"][name], whole[2 * r : 2 * r + 2], **GRAD)


def _tp_rank(rank: int, config: dict[str, Any], x: Tensor, g: Tensor) -> dict[str, Any]:
    return _step(split_hidden(_layer(config), dist.group.WORLD), x, g)


def test_input_weighted_experts_split_over_tp2_equal_the_serial_layer() -> None:
    config = {"d_model": 8, "hidden": 6, "experts": 4, "top_k": 1, "shared_hidden": 4, "seed": 8}
    config["capacity_factor"] = 1.0
    x, g = _data(12, 8, 9)
    runs = run_threaded(2, _tp_rank, config, x, g, timeout=60)
    want = _step(_layer(config), x, g)
    split = {"w1": 2, "w3": 2, "w2": 1}
    for run in runs:
        torch.testing.assert_close(run["y"], want["y"], **OUT)
        torch.testing.assert_close(run["dx"], want["dx"], **OUT)
    for name, grad in want["grads"].items():
        weight = name.rpartition(".")[2]
        if weight in split:  # each rank's half of the hidden units
            got = torch.cat([run["grads"][name] for run in runs], dim=split[weight])
        else:  # the router, whole on each rank: partial sums over tp
            got = runs[0]["grads"][name] + runs[1]["grads"][name]
        torch.testing.assert_close(got, grad, **GRAD)
