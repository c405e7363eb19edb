"""Tier 0: how a layer computes in bf16: the routing weights' dtype (`RouterSpec`'s
``weights_float32``), the sum of each token's weighed rows (in fp32, rounded once) and routing
in the logits' dtype (``in_logits_dtype``), each against a reference written out here with
torch's own bf16 operations, token by token, bit for bit (``torch.equal``: the reference makes the
same roundings in the same order; one rounding more or less moves entries by a bf16 ulp).

In fp32 neither option changes anything: the same layer gives the same output with and without.

Mutations: the weighed rows rounded to bf16 before they are summed, the weights always kept
fp32, and the steps in the logits' dtype skipped: each fails its test.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.moe import MoE
from tessera.moe.router import RouterSpec, route

D, H, E = 16, 8, 6


def _layer(seed: int, top_k: int, spec: RouterSpec, dtype: torch.dtype) -> MoE:
    """A layer of non-gated ``relu(x w1)^2 w2`` experts whose weights are multiples of 1/4 in
    ``[-1/4, 1/4]``: on inputs that are multiples of 1/4 in ``[-1/2, 1/2]`` every product and
    sum inside an expert is exact in fp32 in any order, and each bf16 rounding is one operation's,
    so the experts' rows are the same whatever kernel or batching computes them."""
    layer = MoE(D, H, E, top_k, routing=spec, seed=seed, renormalize=True, activation="relu2")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (layer.experts.w1, layer.experts.w2):
            p.copy_(torch.randint(-1, 2, p.shape, generator=gen) / 4)
    return layer.to(dtype)


def _tokens(seed: int, dtype: torch.dtype) -> Tensor:
    return (torch.randint(-2, 3, (12, D), generator=torch.Generator().manual_seed(seed)) / 4).to(dtype)


def _reference(layer: MoE, x: Tensor, weights_fp32: bool) -> Tensor:
    """Each token alone: its experts' bf16 outputs, each times its weight (fp32 weights: the
    product in fp32; else the weight first rounded to bf16 and the product in bf16), summed in
    fp32 over the token's experts, rounded once."""
    routing = layer.router(x)
    w1, w2, _ = layer.experts.weights()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1], dtype=torch.float32)
        for k in range(routing.choices.shape[1]):
            e = int(routing.choices[t, k])
            y = (torch.relu(x[t] @ w1[e]) ** 2) @ w2[e]
            w = routing.weights[t, k]
            y = y.float() * w if weights_fp32 else y * w.to(x.dtype)  # (a 0-dim w would not promote)
            total = total + y.float()
        out[t] = total.to(x.dtype)
    return out


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.booleans(), st.sampled_from(["softmax", "sigmoid"]))
def test_bf16_rows_are_weighed_in_the_weights_dtype_and_summed_in_fp32(
    seed: int, top_k: int, weights_fp32: bool, score: str
) -> None:
    spec = RouterSpec(score=score, weights_float32=weights_fp32)  # type: ignore[arg-type]
    layer = _layer(seed, top_k, spec, torch.bfloat16)
    x = _tokens(seed, torch.bfloat16)
    with torch.no_grad():
        routing = layer.router(x)
        assert routing.weights.dtype == (torch.float32 if weights_fp32 else torch.bfloat16)
        got = layer(x)
        want = _reference(layer, x, weights_fp32)
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item()}"


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.booleans())
def test_the_options_change_nothing_in_fp32(seed: int, top_k: int, score_sigmoid: bool) -> None:
    score = "sigmoid" if score_sigmoid else "softmax"
    plain = _layer(seed, top_k, RouterSpec(score=score), torch.float32)  # type: ignore[arg-type]
    both = RouterSpec(score=score, weights_float32=True, in_logits_dtype=True)  # type: ignore[arg-type]
    other = _layer(seed, top_k, both, torch.float32)
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(plain(x), other(x))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.booleans(), st.booleans())
def test_routing_in_the_logits_dtype_is_bf16_arithmetic(
    seed: int, top_k: int, sigmoid: bool, biased: bool
) -> None:
    """DBRX's ``softmax(logits, dtype=logits.dtype)`` renormalised in bf16, LFM2's bf16 sigmoid
    plus a bf16 bias: choices and weights as torch computes them in bf16, exactly. The logits
    are rounded to a coarse grid so that ties in bf16 scores occur and must be broken alike."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(64, E, generator=gen) * 4).round() / 4
    logits = logits.to(torch.bfloat16)
    bias = (torch.randn(E, generator=gen) * 0.01).to(torch.bfloat16) if biased else None
    score = "sigmoid" if sigmoid else "softmax"
    spec = RouterSpec(score=score, choice_bias=biased, renorm_eps=1e-6, in_logits_dtype=True)  # type: ignore[arg-type]
    got = route(logits, top_k, renormalize=True, spec=spec, bias=bias)
    scores = logits.sigmoid() if sigmoid else torch.softmax(logits, dim=-1, dtype=logits.dtype)
    choice = scores if bias is None else scores + bias
    choices = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, choices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    assert torch.equal(got.choices, choices)
    assert torch.equal(got.weights.to(torch.bfloat16), weights), (got.weights, weights)
