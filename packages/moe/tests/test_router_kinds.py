"""Tier 0: the routers a `RouterSpec` describes (sigmoid scores, a choice bias, group-limited
choice, a routed scale), by their properties over drawn sizes and logits, and a layer routed so
against a token-by-token reference.

Exactness: choices are compared exactly (the logits are random normals, so ties have
probability zero; a group or expert is checked against the k-th best score, which also holds
under a tie). Weights are compared exactly where the same fp32 operations produce them (the
plain top-k the spec reduces to: ``x + 0.0`` and ``x + 1e-20`` equal ``x`` for the sums here,
at least ``1 / E``), else to rtol 1e-6; the layer against its reference fp32 rtol 1e-5, atol
1e-6 as in ``test_moe_layer.py``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.moe import MoE
from tessera.moe.router import RouterSpec, TopKRouter, route

TOL = {"rtol": 1e-5, "atol": 1e-6}


@st.composite
def routers(draw: st.DrawFn) -> dict[str, Any]:
    """A spec, its sizes, logits and (when the spec has one) a choice bias."""
    groups = draw(st.integers(1, 4))
    per_group = draw(st.integers(1, 4))
    experts = groups * per_group
    top_groups = draw(st.integers(1, groups))
    group_score = "max" if per_group < 2 else draw(st.sampled_from(["max", "top2"]))
    spec = RouterSpec(
        score=draw(st.sampled_from(["softmax", "sigmoid"])),
        choice_bias=draw(st.booleans()),
        groups=groups,
        top_groups=top_groups,
        group_score=group_score,
        scale=draw(st.sampled_from([1.0, 2.5])),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tokens = draw(st.integers(1, 12))
    return {
        "spec": spec,
        "top_k": draw(st.integers(1, top_groups * per_group)),
        "renormalize": draw(st.booleans()),
        "logits": torch.randn(tokens, experts, generator=gen) * 2,
        "bias": torch.randn(experts, generator=gen) * 0.3 if spec.choice_bias else None,
    }


def _scores(spec: RouterSpec, logits: Tensor) -> Tensor:
    return torch.softmax(logits, -1) if spec.score == "softmax" else torch.sigmoid(logits)


def _group_scores(spec: RouterSpec, biased: Tensor) -> Tensor:
    per = biased.view(biased.shape[0], spec.groups, -1)
    return per.max(-1).values if spec.group_score == "max" else per.topk(2, dim=-1).values.sum(-1)


@settings(max_examples=200, deadline=None)
@given(routers())
def test_group_limited_routing_never_picks_an_expert_outside_the_chosen_groups(case: dict[str, Any]) -> None:
    spec, logits, bias, k = case["spec"], case["logits"], case["bias"], case["top_k"]
    routing = route(logits, k, renormalize=case["renormalize"], spec=spec, bias=bias)
    biased = _scores(spec, logits) + (0 if bias is None else bias)
    groups = _group_scores(spec, biased)
    kth_group = groups.topk(spec.top_groups, dim=-1).values[:, -1:]
    per_group = logits.shape[1] // spec.groups
    chosen_groups = routing.choices // per_group
    assert bool((groups.gather(1, chosen_groups) >= kth_group).all())
    # and among the kept groups' experts, the top_k by biased score
    allowed = (groups >= kth_group).repeat_interleave(per_group, dim=1)
    kth = biased.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).values[:, -1:]
    assert bool((biased.gather(1, routing.choices) >= kth).all())
    assert all(len(set(row)) == k for row in routing.choices.tolist())


@settings(max_examples=200, deadline=None)
@given(routers())
def test_the_weights_are_the_unbiased_scores_of_the_choices(case: dict[str, Any]) -> None:
    """Whatever the bias: weights = scores[choices], renormalised when asked, times the scale;
    probs: the scores normalised to sum to 1."""
    spec, logits = case["spec"], case["logits"]
    routing = route(logits, case["top_k"], renormalize=case["renormalize"], spec=spec, bias=case["bias"])
    scores = _scores(spec, logits)
    want = scores.gather(1, routing.choices)
    if case["renormalize"]:
        want = want / (want.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(routing.weights, want * spec.scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(routing.probs.sum(-1), torch.ones(logits.shape[0]), rtol=1e-6, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(routers(), st.data())
def test_the_bias_changes_the_choices_not_the_weights_formula(
    case: dict[str, Any], data: st.DataObject
) -> None:
    """A large bias on one expert of a spec without groups makes every token choose it, and its
    weight stays its unbiased score (renormalised and scaled as ever)."""
    spec = RouterSpec(score=case["spec"].score, choice_bias=True, scale=case["spec"].scale)
    logits, k = case["logits"], case["top_k"]
    favourite = data.draw(st.integers(0, logits.shape[1] - 1))
    bias = torch.zeros(logits.shape[1])
    bias[favourite] = 10.0
    routing = route(logits, k, renormalize=False, spec=spec, bias=bias)
    assert bool((routing.choices[:, 0] == favourite).all())
    torch.testing.assert_close(routing.weights[:, 0], _scores(spec, logits)[:, favourite] * spec.scale)
    unbiased = route(logits, k, renormalize=False, spec=spec, bias=torch.zeros_like(bias))
    want = _scores(spec, logits).topk(k, dim=-1).values * spec.scale
    torch.testing.assert_close(unbiased.weights, want, rtol=1e-6, atol=0)


@settings(max_examples=200, deadline=None)
@given(routers())
def test_all_groups_and_a_zero_bias_reduce_to_plain_top_k(case: dict[str, Any]) -> None:
    """Softmax, every group kept, a zero bias, scale 1: bit for bit the default router."""
    logits, k, norm = case["logits"], case["top_k"], case["renormalize"]
    groups = case["spec"].groups
    spec = RouterSpec(
        choice_bias=True, groups=groups, top_groups=groups, group_score=case["spec"].group_score
    )
    got = route(logits, k, renormalize=norm, spec=spec, bias=torch.zeros(logits.shape[1]))
    want = route(logits, k, renormalize=norm)
    assert torch.equal(got.choices, want.choices)
    assert torch.equal(got.weights, want.weights)
    assert torch.equal(got.probs, want.probs)


def test_a_default_router_holds_no_bias_and_routes_as_before() -> None:
    router = TopKRouter(8, 6, 2, renormalize=True, seed=3)
    assert router.score_bias is None and set(router.state_dict()) == {"weight"}
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(x @ router.weight.t(), dim=-1)
    weights, choices = torch.topk(probs, 2, dim=-1)
    routing = router(x)
    assert torch.equal(routing.choices, choices)
    assert torch.equal(routing.weights, weights / weights.sum(dim=-1, keepdim=True))


def test_the_bias_is_a_buffer_that_training_leaves_alone() -> None:
    spec = RouterSpec(
        score="sigmoid", choice_bias=True, groups=2, top_groups=1, group_score="top2", scale=2.0
    )
    layer = MoE(8, 12, 4, 2, routing=spec, shared_hidden=6, seed=1)
    assert layer.router.score_bias is not None
    assert "router.score_bias" in layer.state_dict()
    assert all(not n.endswith("score_bias") for n, _ in layer.named_parameters())
    layer.router.score_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    before = layer.router.score_bias.clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    layer(x).square().sum().backward()
    opt.step()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert torch.equal(layer.router.score_bias, before)


@torch.no_grad()
def _reference(layer: MoE, x: Tensor) -> Tensor:
    """The layer's output token by token from the definitions (DeepSeek-V3's routing)."""
    spec, bias = layer.router.spec, layer.router.score_bias
    experts, per_group = layer.num_experts, layer.num_experts // spec.groups
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.sigmoid(token @ layer.router.weight.t())
        biased = scores + (0 if bias is None else bias)
        group_score = {
            g: sorted(biased[g * per_group : (g + 1) * per_group].tolist())[-2:] for g in range(spec.groups)
        }
        kept = sorted(range(spec.groups), key=lambda g: -sum(group_score[g]))[: spec.top_groups]
        allowed = [e for e in range(experts) if e // per_group in kept]
        chosen = sorted(allowed, key=lambda e: -float(biased[e]))[: layer.top_k]
        weights = scores[chosen] / scores[chosen].sum() * spec.scale
        y = sum(w * layer.experts.expert(e, token[None])[0] for w, e in zip(weights, chosen, strict=True))
        assert layer.shared is not None
        out.append(y + layer.shared.expert(0, token[None])[0])
    return torch.stack(out).view(x.shape)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([(8, 4, 2, 2), (8, 2, 1, 3), (6, 3, 2, 1), (4, 1, 1, 2)]))
def test_a_layer_routed_like_deepseek_v3_equals_its_reference(
    seed: int, sizes: tuple[int, int, int, int]
) -> None:
    experts, groups, top_groups, k = sizes
    spec = RouterSpec(
        score="sigmoid", choice_bias=True, groups=groups, top_groups=top_groups, group_score="top2", scale=2.5
    )
    layer = MoE(8, 12, experts, k, routing=spec, shared_hidden=6, seed=seed)
    assert layer.router.score_bias is not None
    with torch.no_grad():
        layer.router.score_bias.copy_(
            torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * 0.2
        )
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed + 1))
    torch.testing.assert_close(layer(x), _reference(layer, x), **TOL)


@pytest.mark.parametrize(
    ("spec", "experts", "top_k", "match"),
    [
        (RouterSpec(groups=3), 8, 2, r"groups \(3\) must be >= 1 and divide experts \(8\)"),
        (RouterSpec(groups=4, top_groups=5), 8, 2, r"top_groups \(5\) must be between 1 and groups \(4\)"),
        (
            RouterSpec(groups=4, top_groups=1),
            8,
            3,
            r"top_groups \(1\) x experts per group \(2\) must be >= top_k \(3\)",
        ),
        (
            RouterSpec(groups=4, top_groups=2, group_score="top2"),
            4,
            2,
            r"'top2' needs >= 2 experts per group, got 1",
        ),
        (RouterSpec(scale=0.0), 4, 2, r"scale must be finite and > 0, got 0.0"),
        (RouterSpec(score="relu"), 4, 2, r"score must be 'softmax' or 'sigmoid', got 'relu'"),  # type: ignore[arg-type]
    ],
)
def test_routers_that_cannot_route_are_refused_naming_the_numbers(
    spec: RouterSpec, experts: int, top_k: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(4, 4, experts, top_k, routing=spec, seed=0)


def test_a_bias_must_come_with_its_spec() -> None:
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"a choice bias needs RouterSpec\(choice_bias=True\)"):
        route(logits, 2, renormalize=True, bias=torch.zeros(4))
    with pytest.raises(ValueError, match=r"needs a bias of shape \(4,\) exactly then, got \(3,\)"):
        route(logits, 2, renormalize=True, spec=RouterSpec(choice_bias=True), bias=torch.zeros(3))
    with pytest.raises(
        ValueError, match=r"choice_bias=True needs a bias of shape \(4,\) exactly then, got None"
    ):
        route(logits, 2, renormalize=True, spec=RouterSpec(choice_bias=True))


def test_the_readme_routers_example_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Routers\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    assert namespace["y"].shape == (2, 6, 16)
    weights, groups = namespace["weights"], namespace["groups"]
    torch.testing.assert_close(weights.sum(-1), torch.full((12,), 2.5))
    assert namespace["layer"].router.score_bias is not None and groups.shape == (12, 2)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([RouterSpec(), RouterSpec(score="sigmoid", choice_bias=True)]))
def test_a_float32_router_computes_its_logits_in_fp32_in_a_bf16_layer(seed: int, spec: RouterSpec) -> None:
    """``float32=True`` in a bf16 router: its logits are exactly the fp32 product of its bf16 input
    and weight cast up (what DeepSeek-V3's router computes), not bf16 ones; the rest of the spec
    routes as it did (``is_default`` ignores the dtype)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    pair = (spec, dataclasses.replace(spec, float32=True))
    routers = [TopKRouter(16, 8, 2, renormalize=True, spec=s, seed=seed).to(torch.bfloat16) for s in pair]
    plain, fp32 = (r(x).logits for r in routers)
    want = x.float() @ routers[0].weight.float().t()
    assert plain.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    torch.testing.assert_close(fp32, want, rtol=0, atol=0)  # the same fp32 product, bit for bit
    assert pair[1].is_default == spec.is_default
