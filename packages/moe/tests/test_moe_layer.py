"""Tier 0: the serial layer. The grouped experts against the per-expert loop, the whole
layer against a token-by-token reference written from the definitions (softmax, top-k,
capacity slots filled in token order, the MLPs), the losses against their formulas, and the
refusals.

Tolerance: fp32 rtol 1e-5, atol 1e-6 everywhere. The paths compute the same products per
row, but in other groupings (a padded batched matmul, one matmul per expert, one token at a
time), so only the summation order inside each dot product (at most 32 terms of order 1)
and of the gradients over rows may differ: a few ulps.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.moe import MoE, load_balancing_loss, z_loss

TOL = {"rtol": 1e-5, "atol": 1e-6}


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    experts = draw(st.integers(1, 6))
    return {
        "d_model": draw(st.integers(1, 8)),
        "hidden": draw(st.integers(1, 12)),
        "experts": experts,
        "top_k": draw(st.integers(1, experts)),
        "activation": draw(st.sampled_from(["swiglu", "gelu"])),
        "capacity_factor": draw(st.sampled_from([None, 0.25, 0.5, 1.0, 1.5])),
        "renormalize": draw(st.booleans()),
        "shared_hidden": draw(st.sampled_from([None, 3])),
        "seed": draw(st.integers(0, 2**31)),
    }


def _mlp(layer_experts: torch.nn.Module, e: int, x: Tensor) -> Tensor:
    w1, w2, w3 = layer_experts.w1[e], layer_experts.w2[e], layer_experts.w3
    if w3 is None:
        return F.gelu(x @ w1) @ w2  # type: ignore[no-any-return]
    return (F.silu(x @ w1) * (x @ w3[e])) @ w2  # type: ignore[no-any-return]


def reference(layer: MoE, x: Tensor) -> Tensor:
    """The layer's output written token by token from its definition."""
    tokens = x.reshape(-1, x.shape[-1])
    cap = None
    if layer.capacity_factor is not None:
        cap = math.ceil(layer.capacity_factor * tokens.shape[0] * layer.top_k / layer.num_experts)
    used = [0] * layer.num_experts
    out = []
    for t in range(tokens.shape[0]):
        probs = torch.softmax(tokens[t] @ layer.router.weight.t(), dim=-1)
        order = sorted(range(layer.num_experts), key=lambda e: -float(probs[e]))[: layer.top_k]
        weights = probs[order]
        if layer.router.renormalize:
            weights = weights / weights.sum()
        y = torch.zeros_like(tokens[t])
        for w, e in zip(weights, order, strict=True):
            if cap is None or used[e] < cap:
                used[e] += 1
                y = y + w * _mlp(layer.experts, e, tokens[t : t + 1])[0]
        if layer.shared is not None:
            y = y + _mlp(layer.shared, 0, tokens[t : t + 1])[0]
        out.append(y)
    return torch.stack(out).view(x.shape) if out else torch.zeros_like(x)


def _run(layer: MoE, x: Tensor, cotangent: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    ((y * cotangent).sum() + layer.aux_loss + layer.z_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    assert x.grad is not None
    return torch.cat([y.detach().reshape(-1), x.grad.reshape(-1)]), grads


@settings(max_examples=60)
@given(configs(), st.integers(0, 10), st.integers(0, 2**31))
def test_grouped_equals_the_loop_and_the_token_by_token_reference(
    config: dict[str, object], tokens: int, data_seed: int
) -> None:
    layer = MoE(**config)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.randn(tokens, 2, layer.router.weight.shape[1], generator=gen)
    cotangent = torch.randn(x.shape, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x), reference(layer, x), **TOL, msg=lambda m: f"grouped vs reference: {m}"
        )
    grouped = _run(layer, x, cotangent)
    layer.grouped = False
    loop = _run(layer, x, cotangent)
    torch.testing.assert_close(grouped[0], loop[0], **TOL, msg=lambda m: f"outputs and input grads: {m}")
    assert grouped[1].keys() == loop[1].keys()
    for name, g in grouped[1].items():
        torch.testing.assert_close(g, loop[1][name], **TOL, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_losses_follow_their_formulas() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 4, generator=gen)
    probs = torch.softmax(logits, -1)
    routed = torch.tensor([5, 0, 6, 3])
    want = 4 * sum(float(routed[e]) / 14 * float(probs[:, e].mean()) for e in range(4))
    torch.testing.assert_close(load_balancing_loss(probs, routed), torch.tensor(want), **TOL)
    lse = [float(torch.log(torch.exp(logits[t]).sum())) ** 2 for t in range(7)]
    torch.testing.assert_close(z_loss(logits), torch.tensor(sum(lse) / 7), **TOL)
    uniform = torch.full((5, 4), 0.25)  # uniform probabilities give 1 whatever the counts
    torch.testing.assert_close(load_balancing_loss(uniform, routed), torch.tensor(1.0), **TOL)
    assert float(load_balancing_loss(probs[:0], routed * 0)) == 0.0 and float(z_loss(logits[:0])) == 0.0


def test_the_layer_sets_losses_and_stats_of_its_call() -> None:
    layer = MoE(4, 6, experts=3, top_k=2, capacity_factor=0.5, seed=1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    layer(x)
    routing = layer.router(x)
    routed = torch.bincount(routing.choices.reshape(-1), minlength=3)
    assert torch.equal(layer.stats.tokens_per_expert, routed)
    assert torch.equal(layer.stats.kept, routed.clamp(max=3))  # ceil(0.5 * 8 * 2 / 3) = 3 slots
    assert layer.stats.dropped_fraction == (16 - int(routed.clamp(max=3).sum())) / 16
    torch.testing.assert_close(layer.aux_loss, load_balancing_loss(routing.probs, routed), **TOL)
    torch.testing.assert_close(layer.z_loss, z_loss(routing.logits), **TOL)


def test_a_seeded_layer_leaves_the_global_generator_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = MoE(4, 6, 3, seed=5, shared_hidden=2), MoE(4, 6, 3, seed=5, shared_hidden=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(a.experts.w1[0], a.experts.w1[1])  # one stream per expert


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"experts": 3, "top_k": 4}, r"top_k \(4\) must be between 1 and experts \(3\)"),
        ({"experts": 3, "top_k": 0}, r"top_k \(0\) must be between 1 and experts \(3\)"),
        ({"experts": 0, "top_k": 1}, r"experts must be >= 1, got 0"),
        ({"capacity_factor": 0.0}, r"capacity_factor must be > 0 \(or None for drop-less\), got 0.0"),
        ({"capacity_factor": -0.5}, r"capacity_factor must be > 0 \(or None for drop-less\), got -0.5"),
        (
            {"activation": "relu"},
            r"activation must be one of \('swiglu', 'gelu', 'relu2', 'geglu_tanh'\), got 'relu'",
        ),
        ({"hidden": 0}, r"d_model and hidden must be >= 1, got d_model=4, hidden=0"),
    ],
)
def test_bad_configurations_are_refused_naming_the_values(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"d_model": 4, "hidden": 6, "experts": 4, "top_k": 2, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        MoE(**args)  # type: ignore[arg-type]


def test_a_shared_gate_scales_the_shared_expert_per_token() -> None:
    gated = MoE(d_model=4, hidden=6, experts=3, top_k=2, shared_hidden=5, shared_gate=True, seed=4)
    plain = MoE(d_model=4, hidden=6, experts=3, top_k=2, shared_hidden=5, seed=4)  # the same weights
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    assert gated.shared is not None and gated.shared_gate is not None
    shared = gated.shared.expert(0, x)
    want = plain(x) - shared + torch.sigmoid(x @ gated.shared_gate.t()) * shared
    torch.testing.assert_close(gated(x), want, **TOL)
    with pytest.raises(ValueError, match="shared_gate needs a shared expert"):
        MoE(d_model=4, hidden=6, experts=3, shared_gate=True)
