"""Tiers 0 and 1: shared experts weighed by the router (`MoE`'s ``shared_scores`` and
``shared_experts``, `route`'s ``shared``, the router's trained ``scale``: Inkling's "shared
gammas" and ``global_scale``), against references written here from Inkling's formulas:
serially, under expert parallelism (ep=2) and split over tp (tp=2, with and without sequence
parallelism), ranks as threads.

Inkling's router: ``logits = x @ W.T`` over ``E`` routed and ``S`` shared experts; the routed
chosen by ``topk(sigmoid(routed) + bias)``; ``[chosen routed logits, shared logits]`` turned
into ``exp(logsigmoid - logsumexp(logsigmoid))`` (their sigmoids divided by their sum), times
``route_scale * global_scale``; the first ``k`` weigh the chosen experts, the last ``S`` each
shared expert.

Tolerances: weights against the reference rtol 1e-6 (the same quantities, divided by a sum
rather than through logsumexp); layers and parallel layers against the serial one fp32 rtol
1e-5, atol 1e-6 for outputs and input gradients, rtol 1e-5, atol 1e-5 for parameter gradients
(a few products of order 1, summed in another order, as ``test_moe_routing_options.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributed import ProcessGroup

from tessera.comm import gather_along
from tessera.comm.testing import run_threaded
from tessera.moe import MoE, RouterSpec, shard_experts, split_hidden
from tessera.moe.router import route

close_out = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)  # outputs, input gradients
close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # parameter gradients
E, D, H, K, SCALE = 4, 8, 6, 2, 8.0


def _inkling_weights(logits: Tensor, bias: Tensor, k: int, shared: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inkling's router as transformers writes it: choices, routed weights, shared gammas
    (before ``route_scale * global_scale``)."""
    routed, shared_logits = logits[:, :-shared], logits[:, -shared:]
    choices = torch.topk(torch.sigmoid(routed) + bias, k, dim=-1).indices
    picked = torch.cat([routed.gather(-1, choices), shared_logits], dim=-1)
    log_probs = F.logsigmoid(picked)
    weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
    return choices, weights[:, :k], weights[:, k:]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.integers(1, 10), st.integers(0, 2**31))
def test_the_routers_weights_are_inklings(experts: int, shared: int, tokens: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts + shared, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.5
    k = 1 + seed % experts
    spec = RouterSpec(score="sigmoid", choice_bias=True, scale=SCALE)
    routing = route(logits, k, renormalize=True, spec=spec, bias=bias, shared=shared)
    choices, weights, gammas = _inkling_weights(logits, bias, k, shared)
    assert torch.equal(routing.choices.sort(-1).values, choices.sort(-1).values)
    order = routing.choices.argsort(-1), choices.argsort(-1)  # HF's top-k is unsorted
    got = routing.weights.gather(-1, order[0])
    torch.testing.assert_close(got, (weights * SCALE).gather(-1, order[1]), rtol=1e-6, atol=0)
    assert routing.shared_weights is not None
    torch.testing.assert_close(routing.shared_weights, gammas * SCALE, rtol=1e-6, atol=0)
    total = (routing.weights.sum(-1) + routing.shared_weights.sum(-1)) / SCALE
    torch.testing.assert_close(total, torch.ones(tokens), rtol=1e-6, atol=0)
    assert routing.logits.shape == (tokens, experts) and routing.probs.shape == (tokens, experts)


def _layer(seed: int, shared: int = 2, **extra: Any) -> MoE:
    spec = RouterSpec(score="sigmoid", choice_bias=True, scale=SCALE)
    layer = MoE(
        D, H, E, K, routing=spec, shared_hidden=4, shared_experts=shared, shared_scores=True,
        router_scale=True, seed=seed, **extra,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        assert layer.router.score_bias is not None and layer.router.scale is not None
        layer.router.score_bias.copy_(0.1 * torch.randn(E, generator=gen))
        layer.router.scale.fill_(0.7)  # a trained global scale away from 1
    return layer


def _mlp(w1: Tensor, w3: Tensor, w2: Tensor, x: Tensor) -> Tensor:
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def _reference(layer: MoE, x: Tensor) -> Tensor:
    """Token by token, from the layer's tensors: Inkling's weights (`_inkling_weights`) times
    ``route_scale * global_scale``; the chosen experts and each shared expert weighed by theirs."""
    tokens = x.reshape(-1, D)
    router, experts, shared = layer.router, layer.experts, layer.shared
    assert router.score_bias is not None and router.scale is not None and shared is not None
    assert experts.w3 is not None and shared.w3 is not None
    s = shared.count
    choices, weights, gammas = _inkling_weights(tokens @ router.weight.t(), router.score_bias, K, s)
    weights, gammas = weights * SCALE * router.scale, gammas * SCALE * router.scale
    out = []
    for t, token in enumerate(tokens):
        y = torch.zeros_like(token)
        for j, e in enumerate(choices[t].tolist()):
            y = y + weights[t, j] * _mlp(experts.w1[e], experts.w3[e], experts.w2[e], token)
        for j in range(s):
            y = y + gammas[t, j] * _mlp(shared.w1[j], shared.w3[j], shared.w2[j], token)
        out.append(y)
    return torch.stack(out).view(x.shape)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.booleans())
def test_shared_experts_are_weighed_by_the_router(seed: int, shared: int, grouped: bool) -> None:
    """Outputs and every gradient (the router's shared rows and its global scale included)."""
    layer = _layer(seed, shared, grouped=grouped)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(seed + 1))
    g = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(seed + 2))
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = _reference(layer, x_ref), layer(x_got)
    close_out(got, want)
    names, params = zip(*layer.named_parameters(), strict=True)
    want_grads = torch.autograd.grad((want * g).sum(), [x_ref, *params])
    got_grads = torch.autograd.grad((got * g).sum(), [x_got, *params])
    close_out(got_grads[0], want_grads[0])
    for name, a, b in zip(names, got_grads[1:], want_grads[1:], strict=True):
        close_grad(a, b)
        if name in ("router.scale", "router.weight"):
            assert float(a.abs().sum()) > 0, name
    assert layer.router.weight.shape == (E + shared, D)


def test_the_shared_weights_decide_the_output() -> None:
    """The same shared experts unweighed (each output as it is), or the global scale left at 1,
    compute something else: the tests above could fail."""
    layer = _layer(3)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = layer(x)
        plain = MoE(D, H, E, K, routing=layer.router.spec, shared_hidden=4, shared_experts=2, seed=3)
        state = {k: v for k, v in layer.state_dict().items() if k not in ("router.weight", "router.scale")}
        plain.load_state_dict(state, strict=False)
        plain.router.weight.copy_(layer.router.weight[:E])
        assert not torch.allclose(plain(x), want, rtol=1e-5, atol=1e-6)
        assert layer.router.scale is not None
        layer.router.scale.fill_(1.0)
        assert not torch.allclose(layer(x), want, rtol=1e-5, atol=1e-6)


def _world() -> ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _run(layer: MoE, x: Tensor, g: Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    out = layer(x)
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((out * g).sum(), [x, *params.values()])
    return {"out": out.detach(), "x_grad": grads[0], "grads": dict(zip(params, grads[1:], strict=True))}


def _ep_rank(rank: int, seed: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    return _run(shard_experts(_layer(seed), _world()), xs[rank], gs[rank])


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31))
def test_shared_gammas_under_expert_parallelism_equal_the_serial_layer(seed: int) -> None:
    """ep=2: every rank runs the shared experts on its own tokens with its own gammas; the
    router's and the shared experts' gradients summed over the ranks are the serial ones."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 5, D, generator=gen) for _ in range(2)]
    gs = [torch.randn(2, 5, D, generator=gen) for _ in range(2)]
    runs = run_threaded(2, _ep_rank, seed, xs, gs, timeout=60)
    serial = [_run(_layer(seed), x, g) for x, g in zip(xs, gs, strict=True)]
    for run, want in zip(runs, serial, strict=True):
        close_out(run["out"], want["out"])
        close_out(run["x_grad"], want["x_grad"])
    for name in ("router.weight", "router.scale", "shared.w1", "shared.w2", "shared.w3"):
        close_grad(sum(run["grads"][name] for run in runs), sum(s["grads"][name] for s in serial))
    w2 = sum(s["grads"]["experts.w2"] for s in serial)
    for r, run in enumerate(runs):
        close_grad(run["grads"]["experts.w2"], w2[2 * r : 2 * r + 2])


def _tp_rank(rank: int, seed: int, x: Tensor, g: Tensor, sp: bool) -> dict[str, Any]:
    group = _world()
    layer = split_hidden(_layer(seed), group, sequence_parallel=sp)
    mine = (x.chunk(2, dim=-2)[rank] if sp else x).clone().requires_grad_()
    out = layer(mine)
    whole = gather_along(out, -2, group) if sp else out  # the caller's loss is the same on every rank
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((whole * g).sum(), [mine, *params.values()])
    return {"out": out.detach(), "x_grad": grads[0], "grads": dict(zip(params, grads[1:], strict=True))}


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31), st.booleans())
def test_shared_gammas_split_over_tp_equal_the_serial_layer(seed: int, sp: bool) -> None:
    """tp=2: each rank weighs its share of every shared expert's output by the whole gammas
    (the sum over tp is the weighted whole); the router's weight and scale, whole on every
    rank, have partial gradients whose sum over tp is serial."""
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(2, 4, D, generator=gen), torch.randn(2, 4, D, generator=gen)
    serial = _run(_layer(seed), x, g)
    runs = run_threaded(2, _tp_rank, seed, x, g, sp, timeout=60)
    for r, run in enumerate(runs):
        close_out(run["out"], serial["out"].chunk(2, dim=-2)[r] if sp else serial["out"])
        close_out(run["x_grad"], serial["x_grad"].chunk(2, dim=-2)[r] if sp else serial["x_grad"])
    for name in ("router.weight", "router.scale"):
        close_grad(torch.stack([run["grads"][name] for run in runs]).sum(0), serial["grads"][name])
    close_grad(torch.cat([run["grads"]["shared.w2"] for run in runs], dim=1), serial["grads"]["shared.w2"])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"shared_scores": True}, r"needs a shared expert \(shared_hidden\)"),
        (
            {"shared_scores": True, "shared_hidden": 4, "shared_gate": True},
            r"gated \(shared_gate\) or weighed by the router \(shared_scores\), not both",
        ),
        ({"shared_hidden": 4, "shared_experts": 0}, r"shared_experts must be >= 1 \(got 0\)"),
        (
            {"shared_scores": True, "shared_hidden": 4},
            r"a router scoring 1 shared experts needs sigmoid scores, got 'softmax'",
        ),
    ],
)
def test_bad_shared_experts_are_refused_naming_the_values(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(D, H, E, K, seed=0, **extra)


def test_route_refuses_shared_logits_with_a_softmax() -> None:
    with pytest.raises(ValueError, match=r"a router scoring 2 shared experts needs sigmoid scores"):
        route(torch.zeros(3, 6), 2, renormalize=True, spec=RouterSpec(), shared=2)
