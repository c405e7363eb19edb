"""Tiers 0 and 1: what the router and the experts read (Gemma 4's mixture in `MoE`'s terms):
the router through a weightless RMS norm times a trained ``router.input_scale [d]`` and a constant
(``router_norm_eps``, ``router_input_multiplier``), each chosen weight times a trained
``router.expert_scale [E]`` (``router_expert_scale``), the experts an RMS-normed copy of the
input with a weight of its own (``input_norm_eps``), the gated GELU (tanh) activation
(``"geglu_tanh"``) and a post-norm; against a token-by-token reference written here, serially
(grouped and one expert at a time), at ep=2 and split inside over tp=2 (ranks as threads).

Tolerances, fp32: rtol 1e-5, atol 1e-6 for outputs and input gradients, atol 1e-5 for parameter
gradients: the same products, batched (under ep exchanged, under tp summed over two halves of
the hidden units) against one token at a time, so only the summation order differs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tessera.comm.testing import run_threaded
from tessera.moe import MoE, shard_experts, split_hidden

OUT = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-5, "atol": 1e-5}
GEMMA = {
    "activation": "geglu_tanh",
    "router_norm_eps": 1e-6,
    "router_input_multiplier": 8**-0.5,
    "router_expert_scale": True,
    "input_norm_eps": 1e-5,
    "post_norm_eps": 1e-6,
}
CONFIG = {"d_model": 8, "hidden": 6, "experts": 4, "top_k": 2, **GEMMA}


def _layer(config: dict[str, Any], seed: int = 1) -> MoE:
    layer = MoE(**config, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # the trained norms and scales away from their ones, the logits order 1
        layer.router.weight.mul_(4.0)
        for p in (layer.router.input_scale, layer.router.expert_scale, layer.input_norm, layer.post_norm):
            if p is not None:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return layer


def _rms(x: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference(layer: MoE, x: Tensor) -> Tensor:
    """The mixture one token at a time with ``layer``'s weights, drop-less, softmax top-k renormalised."""
    router, bank = layer.router, layer.experts
    assert router.input_scale is not None and router.expert_scale is not None and bank.w3 is not None
    assert layer.input_norm is not None and layer.post_norm is not None
    tokens = x.reshape(-1, x.shape[-1])
    rows = []
    for t in tokens:
        read = _rms(t, 1e-6) * router.input_scale * 8**-0.5
        probs = torch.softmax(read @ router.weight.t(), dim=-1)
        top, choices = torch.topk(probs, layer.top_k)
        weights = top / top.sum() * router.expert_scale[choices]
        fed = layer.input_norm * _rms(t, 1e-5)
        row = t.new_zeros(t.shape)
        for k in range(layer.top_k):
            c = int(choices[k])
            hidden = F.gelu(fed @ bank.w1[c], approximate="tanh") * (fed @ bank.w3[c])
            row = row + weights[k] * (hidden @ bank.w2[c])
        rows.append(layer.post_norm * _rms(row, 1e-6))
    return torch.stack(rows).view(x.shape)


def _step(layer: MoE, x: Tensor, g: Tensor, reference: bool = False) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    y = _reference(layer, x) if reference else layer(x)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return {"y": y.detach(), "dx": x.grad, "grads": grads}


def _data(tokens: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 8, generator=gen) * 3, torch.randn(tokens, 8, generator=gen)


TRAINED = ("router.input_scale", "router.expert_scale", "input_norm", "post_norm", "router.weight")


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_the_layer_equals_the_reference(grouped: bool) -> None:
    layer = _layer(CONFIG)
    layer.grouped = grouped
    x, g = _data(12, 5)
    got, want = _step(layer, x, g), _step(layer, x, g, reference=True)
    torch.testing.assert_close(got["y"], want["y"], **OUT)
    torch.testing.assert_close(got["dx"], want["dx"], **OUT)
    assert got["grads"].keys() == want["grads"].keys() and set(TRAINED) <= set(got["grads"])
    torch.testing.assert_close(got["grads"], want["grads"], **GRAD)


@pytest.mark.parametrize(
    "detail", ["input_scale", "multiplier", "expert_scale", "input_norm", "activation", "router_norm"]
)
def test_each_option_decides_the_output(detail: str) -> None:
    """Without each option the layer computes something else on these inputs (so the test above
    could fail): the router's input scale, its multiplier, its per-expert scale, the experts'
    input norm, the tanh GELU (against SwiGLU), the router's norm (reading the input as it is)."""
    layer = _layer(CONFIG)
    x, _ = _data(12, 5)
    with torch.no_grad():
        want = layer(x)
        if detail == "input_scale":
            layer.router.input_scale = None
        elif detail == "multiplier":
            layer.router.input_multiplier = 1.0
        elif detail == "expert_scale":
            layer.router.expert_scale = None
        elif detail == "input_norm":
            layer.input_norm = None
        elif detail == "activation":
            layer.experts.activation = "swiglu"
        else:
            layer.router.input_norm_eps = None
            layer.router.input_scale = None
        assert (layer(x) - want).abs().max() > 1e-3, detail


def test_bad_options_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"input_norm_eps must be finite and > 0 \(or None\), got 0.0"):
        MoE(8, 4, 4, input_norm_eps=0.0, seed=0)
    with pytest.raises(ValueError, match=r"router's input_norm_eps must be finite and > 0 .*got -1.0"):
        MoE(8, 4, 4, router_norm_eps=-1.0, seed=0)
    with pytest.raises(ValueError, match=r"router's input_multiplier must be finite and > 0, got 0.0"):
        MoE(8, 4, 4, router_input_multiplier=0.0, seed=0)
    with pytest.raises(ValueError, match=r"identity_experts \(2\) with input_norm_eps \(1e-06\)"):
        MoE(8, 4, 4, identity_experts=2, input_norm_eps=1e-6, seed=0)


def _ep_rank(rank: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    return _step(shard_experts(_layer(CONFIG), dist.group.WORLD), xs[rank], gs[rank])


def test_at_ep2_each_rank_equals_the_serial_layer_on_its_tokens() -> None:
    (x0, g0), (x1, g1) = _data(10, 6), _data(7, 7)
    runs = run_threaded(2, _ep_rank, [x0, x1], [g0, g1], timeout=60)
    serial = _layer(CONFIG)
    want = [_step(serial, x, g) for x, g in ((x0, g0), (x1, g1))]
    for got, exp in zip(runs, want, strict=True):
        torch.testing.assert_close(got["y"], exp["y"], **OUT)
        torch.testing.assert_close(got["dx"], exp["dx"], **OUT)
    for name in TRAINED:  # replicated: summed over ep (as data parallelism does)
        total = runs[0]["grads"][name] + runs[1]["grads"][name]
        torch.testing.assert_close(total, want[0]["grads"][name] + want[1]["grads"][name], **GRAD)
    for r, run in enumerate(runs):  # each rank's two experts
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            whole = want[0]["grads"][name] + want[1]["grads"][name]
            torch.testing.assert_close(run["grads"][name], whole[2 * r : 2 * r + 2], **GRAD)


def _tp_rank(rank: int, x: Tensor, g: Tensor) -> dict[str, Any]:
    return _step(split_hidden(_layer(CONFIG), dist.group.WORLD), x, g)


def test_split_over_tp2_it_equals_the_serial_layer() -> None:
    """Every rank the serial output and input gradient; the experts' gradients split along the
    hidden units; the router's, its scales' and the norms' whole on each rank, partial sums."""
    x, g = _data(12, 9)
    runs = run_threaded(2, _tp_rank, x, g, timeout=60)
    want = _step(_layer(CONFIG), x, g)
    split = {"w1": 2, "w3": 2, "w2": 1}
    for run in runs:
        torch.testing.assert_close(run["y"], want["y"], **OUT)
        torch.testing.assert_close(run["dx"], want["dx"], **OUT)
    for name, grad in want["grads"].items():
        weight = name.rpartition(".")[2]
        if weight in split:
            got = torch.cat([run["grads"][name] for run in runs], dim=split[weight])
        else:
            got = runs[0]["grads"][name] + runs[1]["grads"][name]
        torch.testing.assert_close(got, grad, **GRAD)
