"""Tiers 0 and 1: GPT-OSS's mixture (`MoE` with ``router_bias``, ``expert_bias`` and the
`ClampedSwiGLU` activation), serial against a plain-torch reference, expert-parallel over ep=2
and split inside over tp=2 against the serial layer.

The reference routes as GPT-OSS does (top-k of the biased logits, softmax over those k) and
runs every kept assignment through its expert one row at a time: ``g = x @ w1 + b1``, ``u = x @
w3 + b3``, ``((u.clamp(-l, l) + 1) * g' * sigmoid(alpha * g')) @ w2 + b2`` with ``g' =
g.clamp(max=l)``, weighted by its score. The biases are drawn (they start at zero) and the
limit is small (0.5), so that both clamps and every bias change the output (the first test
checks that the clamp does).

Tolerances, fp32: rtol 1e-5, atol 1e-6 for outputs and input gradients, atol 1e-5 for
parameter gradients: the same products, batched (under ep exchanged, under tp summed over two
halves of the hidden units) against one row at a time, so only the summation order differs.
Under tp the down projection's bias ``b2`` is added by the rank holding hidden unit 0 alone:
its gradient there is the serial one, zero on the other, so their sum is the serial one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm.testing import run_threaded
from tessera.moe import ClampedSwiGLU, MoE, shard_experts, split_hidden

OUT = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-5, "atol": 1e-5}
ACT = ClampedSwiGLU(alpha=1.702, limit=0.5)
CONFIG = {
    "d_model": 8, "hidden": 6, "experts": 4, "top_k": 2, "activation": ACT, "expert_bias": True,
    "router_bias": True, "capacity_factor": 1.0, "seed": 3,
}  # fmt: skip


def _layer(config: dict[str, Any]) -> MoE:
    layer = MoE(**config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # biases of their own: they start at zero
        for name, p in layer.named_parameters():
            if name.rpartition(".")[2] in ("bias", "b1", "b2", "b3"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer


def _reference(layer: MoE, x: Tensor) -> Tensor:
    bank, router = layer.experts, layer.router
    assert bank.w3 is not None and bank.b1 is not None and bank.b2 is not None and bank.b3 is not None
    assert router.bias is not None and isinstance(bank.activation, ClampedSwiGLU)
    limit, alpha = bank.activation.limit, bank.activation.alpha
    logits = x @ router.weight.t() + router.bias
    top, choices = torch.topk(logits, layer.top_k, dim=-1)
    scores = torch.softmax(top, dim=-1)
    cap = int(torch.ceil(torch.tensor(layer.capacity_factor * x.shape[0] * layer.top_k / layer.num_experts)))
    seen = [0] * layer.num_experts
    rows = []
    for i in range(x.shape[0]):
        row = x.new_zeros(x.shape[1])
        for k in range(layer.top_k):
            e = int(choices[i, k])
            seen[e] += 1
            if seen[e] > cap:
                continue
            g = (x[i] @ bank.w1[e] + bank.b1[e]).clamp(max=limit)
            u = (x[i] @ bank.w3[e] + bank.b3[e]).clamp(-limit, limit)
            row = row + scores[i, k] * (((u + 1) * g * torch.sigmoid(alpha * g)) @ bank.w2[e] + bank.b2[e])
        rows.append(row)
    return torch.stack(rows)


def _step(layer: MoE, x: Tensor, g: Tensor, reference: bool = False) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    y = _reference(layer, x) if reference else layer(x)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return {"y": y.detach(), "dx": x.grad, "grads": grads}


def _data(tokens: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 8, generator=gen), torch.randn(tokens, 8, generator=gen)


def test_gpt_oss_experts_equal_the_reference() -> None:
    layer = _layer(CONFIG)
    x, g = _data(12, 5)
    got, want = _step(layer, x, g), _step(layer, x, g, reference=True)
    torch.testing.assert_close(got["y"], want["y"], **OUT)
    torch.testing.assert_close(got["dx"], want["dx"], **OUT)
    assert {"router.bias", "experts.b1", "experts.b2", "experts.b3"} <= got["grads"].keys()
    assert got["grads"].keys() == want["grads"].keys()
    torch.testing.assert_close(got["grads"], want["grads"], **GRAD)
    assert layer.stats.dropped_fraction > 0  # the capacity drops some
    layer.experts.activation = ClampedSwiGLU(alpha=1.702, limit=100.0)  # the clamp matters
    assert (layer(x) - got["y"]).abs().max() > 1e-2


def _ep_rank(rank: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    return _step(shard_experts(_layer(CONFIG), dist.group.WORLD), xs[rank], gs[rank])


def test_gpt_oss_experts_at_ep2_equal_the_serial_layer_on_each_shard() -> None:
    (x0, g0), (x1, g1) = _data(10, 6), _data(7, 7)
    runs = run_threaded(2, _ep_rank, [x0, x1], [g0, g1], timeout=60)
    serial = _layer(CONFIG)
    want = [_step(serial, x, g) for x, g in ((x0, g0), (x1, g1))]
    for got, exp in zip(runs, want, strict=True):
        torch.testing.assert_close(got["y"], exp["y"], **OUT)
        torch.testing.assert_close(got["dx"], exp["dx"], **OUT)
    for name in want[0]["grads"]:
        whole = want[0]["grads"][name] + want[1]["grads"][name]
        if name.startswith("experts."):  # each rank's two experts, biases included
            for r, run in enumerate(runs):
                torch.testing.assert_close(run["grads"][name], whole[2 * r : 2 * r + 2], **GRAD)
        else:  # the router's weight and bias, replicated: summed over ep
            torch.testing.assert_close(runs[0]["grads"][name] + runs[1]["grads"][name], whole, **GRAD)


def _tp_rank(rank: int, x: Tensor, g: Tensor) -> dict[str, Any]:
    return _step(split_hidden(_layer(CONFIG), dist.group.WORLD), x, g)


def test_gpt_oss_experts_split_over_tp2_equal_the_serial_layer() -> None:
    x, g = _data(12, 9)
    runs = run_threaded(2, _tp_rank, x, g, timeout=60)
    want = _step(_layer(CONFIG), x, g)
    split = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}  # b2 [E, d]: whole
    for run in runs:
        torch.testing.assert_close(run["y"], want["y"], **OUT)
        torch.testing.assert_close(run["dx"], want["dx"], **OUT)
    for name, grad in want["grads"].items():
        weight = name.rpartition(".")[2]
        if weight in split:
            got = torch.cat([run["grads"][name] for run in runs], dim=split[weight])
        else:  # the router and b2, whole on each rank: partial sums over tp
            got = runs[0]["grads"][name] + runs[1]["grads"][name]
        torch.testing.assert_close(got, grad, **GRAD)
