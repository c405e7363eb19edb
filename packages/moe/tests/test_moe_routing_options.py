"""Tiers 0 and 1: the router details some families change (`RouterSpec`'s ``choose_by``,
``group_fill``, ``renorm_eps``) and identity experts (`MoE`'s ``identity_experts``), each
against a token-by-token reference, serially, under expert parallelism and split over tp.

Exactness: choices are compared exactly (random normal logits: ties have probability zero);
weights made by the same fp32 operations as the reference exactly, else rtol 1e-6. Layers
against their references, and parallel layers against the serial one, fp32 rtol 1e-5, atol
1e-6 for outputs and input gradients (a few products of order 1 summed in another order),
rtol 1e-5, atol 1e-5 for parameter gradients (sums over up to 32 rows, per rank then over
ranks), as ``test_moe_ep.py`` and ``test_moe_tp.py``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributed import ProcessGroup

import tessera.moe.layer as layer_module
from tessera.comm import gather_along
from tessera.comm.testing import run_threaded
from tessera.moe import MoE, shard_experts, split_hidden
from tessera.moe.exchange import dispatch as real_dispatch
from tessera.moe.router import RouterSpec, ScoreFunction, route

close_out = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)  # outputs, input gradients
close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # parameter gradients


def _logits(tokens: int, experts: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=gen) * 2, torch.randn(experts, generator=gen) * 0.5


# ---------------------------------------------------------------------------- router options
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 10), st.integers(0, 2**31), st.booleans(), st.booleans())
def test_choosing_by_logits_plus_bias_weighs_by_the_unbiased_scores(
    experts: int, tokens: int, seed: int, renormalize: bool, softmax: bool
) -> None:
    """Kolibri's router: ``topk(logits + bias)``, weighed by the chosen experts' scores."""
    logits, bias = _logits(tokens, experts, seed)
    k = 1 + seed % experts
    spec = RouterSpec(score="softmax" if softmax else "sigmoid", choice_bias=True, choose_by="logits")
    routing = route(logits, k, renormalize=renormalize, spec=spec, bias=bias)
    assert torch.equal(routing.choices, torch.topk(logits + bias, k, dim=-1).indices)
    scores = torch.softmax(logits, -1) if softmax else torch.sigmoid(logits)
    want = scores.gather(1, routing.choices)
    if renormalize:
        want = want / (want.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(routing.weights, want, rtol=1e-6, atol=0)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 10), st.integers(0, 2**31), st.booleans())
def test_without_a_bias_choosing_by_logits_is_choosing_by_scores(
    experts: int, tokens: int, seed: int, softmax: bool
) -> None:
    """Both score functions are monotone in the logits: the same experts, the same weights."""
    logits, _ = _logits(tokens, experts, seed)
    k = 1 + seed % experts
    score: ScoreFunction = "softmax" if softmax else "sigmoid"
    by_logits = route(
        logits, k, renormalize=True, spec=RouterSpec(score=score, choose_by="logits", scale=2.0)
    )
    by_scores = route(logits, k, renormalize=True, spec=RouterSpec(score=score, scale=2.0))
    assert torch.equal(by_logits.choices, by_scores.choices)
    assert torch.equal(by_logits.weights, by_scores.weights)


def _masked_to(fill: float, biased: Tensor, groups: int, top_groups: int) -> Tensor:
    """The reference group mask, token by token (DeepSeek-V3's group score: the best two)."""
    out = biased.clone()
    for t in range(biased.shape[0]):
        per = biased[t].view(groups, -1)
        kept = per.topk(2, dim=-1).values.sum(-1).topk(top_groups).indices.tolist()
        for g in range(groups):
            if g not in kept:
                out[t].view(groups, -1)[g] = fill
    return out


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([(8, 4, 2, 2), (8, 2, 1, 3), (6, 3, 2, 2)]))
def test_groups_masked_to_zero_choose_as_axk2s_router(seed: int, sizes: tuple[int, int, int, int]) -> None:
    """Outside the kept groups the choice is 0.0: an expert there beats a negative biased
    score inside them (biases drawn around -0.6, so that happens)."""
    experts, groups, top_groups, k = sizes
    logits, bias = _logits(6, experts, seed)
    bias = bias - 0.6
    spec = RouterSpec(
        score="sigmoid", choice_bias=True, groups=groups, top_groups=top_groups, group_score="top2"
    )
    routing = route(logits, k, renormalize=True, spec=replace(spec, group_fill=0.0), bias=bias)
    biased = torch.sigmoid(logits) + bias
    want = torch.topk(_masked_to(0.0, biased, groups, top_groups), k, dim=-1).indices
    assert torch.equal(routing.choices, want)


def test_a_zero_fill_chooses_outside_the_kept_groups_where_minus_inf_does_not() -> None:
    """One token, 4 experts in 2 groups, 1 kept, top-2: biased scores ``[0.9, -0.2, -0.9,
    -0.9]``, group 0 kept (0.7 against -1.8); its second expert's -0.2 loses to the 0.0 of
    group 1's experts."""
    logits = torch.logit(torch.tensor([[0.9, 0.8, 0.1, 0.1]]))
    bias = torch.tensor([0.0, -1.0, -1.0, -1.0])
    spec = RouterSpec(score="sigmoid", choice_bias=True, groups=2, top_groups=1, group_score="top2")
    inf = route(logits, 2, renormalize=False, spec=spec, bias=bias)
    zero = route(logits, 2, renormalize=False, spec=replace(spec, group_fill=0.0), bias=bias)
    assert sorted(inf.choices[0].tolist()) == [0, 1]
    assert zero.choices[0, 0].item() == 0 and zero.choices[0, 1].item() in (2, 3)


def test_the_renormalisation_guard_is_the_specs() -> None:
    """LFM2's ``sum + 1e-6``: visible where the chosen scores are small (logits near -14)."""
    logits = torch.tensor([[-14.0, -14.5, -20.0]])
    for eps in (1e-20, 1e-6):
        got = route(logits, 2, renormalize=True, spec=RouterSpec(score="sigmoid", renorm_eps=eps)).weights
        chosen = torch.sigmoid(logits)[:, :2]
        assert torch.equal(got, chosen / (chosen.sum(-1, keepdim=True) + eps))
    small = route(logits, 2, renormalize=True, spec=RouterSpec(score="sigmoid", renorm_eps=1e-6)).weights
    assert float(small.sum()) < 0.6  # the guard outweighs the scores (sum about 1.4e-6)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (RouterSpec(choose_by="bias"), r"choose_by must be 'scores' or 'logits', got 'bias'"),  # type: ignore[arg-type]
        (RouterSpec(group_fill=float("nan")), r"group_fill must be -inf or finite, got nan"),
        (RouterSpec(group_fill=float("inf")), r"group_fill must be -inf or finite, got inf"),
        (RouterSpec(renorm_eps=-1e-6), r"renorm_eps must be finite and >= 0, got -1e-06"),
    ],
)
def test_bad_router_options_are_refused_naming_the_value(spec: RouterSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        route(torch.zeros(2, 4), 2, renormalize=True, spec=spec)
    with pytest.raises(ValueError, match=match):
        MoE(4, 4, 4, 2, routing=spec, seed=0)


# ---------------------------------------------------------------------------- identity experts
def _identity_layer(seed: int, experts: int = 4, identity: int = 2, k: int = 2, **extra: Any) -> MoE:
    spec = RouterSpec(choice_bias=True, scale=1.5)
    layer = MoE(
        8, 6, experts, k, renormalize=False, routing=spec, identity_experts=identity, seed=seed, **extra
    )
    assert layer.router.score_bias is not None
    with torch.no_grad():  # the first identity expert favoured, so that some tokens choose it
        bias = torch.randn(experts + identity, generator=torch.Generator().manual_seed(seed)) * 0.05
        bias[experts] += 0.2
        layer.router.score_bias.copy_(bias)
    return layer


def _identity_reference(layer: MoE, x: Tensor) -> Tensor:
    """Token by token: each choice below ``E`` its expert's output, else the token, weighed."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    out = []
    for t, token in enumerate(tokens):
        y = torch.zeros_like(token)
        for w, e in zip(routing.weights[t], routing.choices[t].tolist(), strict=True):
            y = y + w * (layer.experts.expert(e, token[None])[0] if e < layer.num_experts else token)
        out.append(y if layer.shared is None else y + layer.shared.expert(0, token[None])[0])
    return torch.stack(out).view(x.shape)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([(4, 2, 2), (4, 4, 3), (2, 1, 1)]), st.booleans())
def test_identity_experts_give_the_weighed_token(
    seed: int, sizes: tuple[int, int, int], shared: bool
) -> None:
    experts, identity, k = sizes
    layer = _identity_layer(seed, experts, identity, k, shared_hidden=4 if shared else None)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed + 1))
    g = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed + 2))
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = _identity_reference(layer, x_ref), layer(x_got)
    close_out(got, want)
    wrt = [layer.router.weight, layer.experts.w1]  # w1 unused where every token chose an identity expert
    want_grads = torch.autograd.grad((want * g).sum(), [x_ref, *wrt], allow_unused=True)
    got_grads = torch.autograd.grad((got * g).sum(), [x_got, *wrt], allow_unused=True)
    for a, b, t in zip(got_grads, want_grads, [x, *wrt], strict=True):
        close_grad(torch.zeros_like(t) if a is None else a, torch.zeros_like(t) if b is None else b)
    choices = layer.router(x.reshape(-1, 8)).choices
    real = choices[choices < experts]
    assert torch.equal(layer.stats.routed, torch.bincount(real, minlength=experts))  # real experts only
    assert layer.router.weight.shape == (experts + identity, 8)


def test_identity_experts_are_chosen_in_these_tests() -> None:
    """The drawn bias makes the identity path carry tokens (else the tests above prove little)."""
    layer = _identity_layer(3)
    choices = layer.router(torch.randn(15, 8, generator=torch.Generator().manual_seed(4))).choices
    assert int((choices >= 4).sum()) > 0 and int((choices < 4).sum()) > 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"identity_experts": -1}, r"identity_experts must be >= 0, got -1"),
        (
            {"identity_experts": 2, "capacity_factor": 1.0},
            r"identity_experts \(2\) are drop-less: capacity_factor must be None, got 1.0",
        ),
        (
            {"identity_experts": 1, "top_k": 6},
            r"top_k \(6\) must be between 1 and experts \(4\) \+ identity experts \(1\)",
        ),
    ],
)
def test_bad_identity_experts_are_refused_naming_the_numbers(extra: dict[str, Any], match: str) -> None:
    config: dict[str, Any] = {"d_model": 4, "hidden": 4, "experts": 4, "top_k": 2, "seed": 0, **extra}
    with pytest.raises(ValueError, match=match):
        MoE(**config)


def _loss(layer: MoE, out: Tensor, g: Tensor) -> Tensor:
    return (out * g).sum() + 0.1 * layer.aux_loss


def _run(layer: MoE, x: Tensor, g: Tensor) -> dict[str, Any]:
    """One forward and backward of ``layer``: its output, input gradient and parameter gradients."""
    x = x.clone().requires_grad_()
    out = layer(x)
    grads = torch.autograd.grad(_loss(layer, out, g), [x, *layer.parameters()], allow_unused=True)
    names = [n for n, _ in layer.named_parameters()]
    kept = {n: grad for n, grad in zip(names, grads[1:], strict=True) if grad is not None}
    return {"out": out.detach(), "x_grad": grads[0], "grads": kept}


def _serial(seed: int, x: Tensor, g: Tensor) -> dict[str, Any]:
    return _run(_identity_layer(seed), x, g)


def _world() -> ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _ep_rank(rank: int, seed: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    return _run(shard_experts(_identity_layer(seed), _world()), xs[rank], gs[rank])


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31))
def test_identity_experts_under_expert_parallelism_equal_the_serial_layer(seed: int) -> None:
    """ep=2, each rank its own tokens; only the real experts' rows travel (the rows every
    `dispatch` sends add up to the real assignments)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 5, 8, generator=gen) for _ in range(2)]
    gs = [torch.randn(2, 5, 8, generator=gen) for _ in range(2)]
    sent: list[int] = []

    def recording(rows: Tensor, ex: Any, group: Any) -> Tensor:
        sent.append(rows.shape[0])
        return real_dispatch(rows, ex, group)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(layer_module, "dispatch", recording)
        runs = run_threaded(2, _ep_rank, seed, xs, gs, timeout=60)
    serial = [_serial(seed, x, g) for x, g in zip(xs, gs, strict=True)]
    serial_layer = _identity_layer(seed)
    real = sum(int((serial_layer.router(x.reshape(-1, 8)).choices < 4).sum()) for x in xs)
    assert sum(sent) == real
    for run, want in zip(runs, serial, strict=True):
        close_out(run["out"], want["out"])
        close_out(run["x_grad"], want["x_grad"])
    router = sum(want["grads"]["router.weight"] for want in serial)
    close_grad(sum(run["grads"]["router.weight"] for run in runs), router)
    w1 = sum(want["grads"]["experts.w1"] for want in serial)
    for r, run in enumerate(runs):
        close_grad(run["grads"]["experts.w1"], w1[2 * r : 2 * r + 2])


def _tp_rank(rank: int, seed: int, x: Tensor, g: Tensor, sp: bool) -> dict[str, Any]:
    group = _world()
    layer = split_hidden(_identity_layer(seed), group, sequence_parallel=sp)
    mine = (x.chunk(2, dim=-2)[rank] if sp else x).clone().requires_grad_()
    out = layer(mine)
    whole = gather_along(out, -2, group) if sp else out  # the caller's loss is the same on every rank
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad(_loss(layer, whole, g), [mine, *params.values()], allow_unused=True)
    kept = {n: grad for n, grad in zip(params, grads[1:], strict=True) if grad is not None}
    return {"out": out.detach(), "x_grad": grads[0], "grads": kept}


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31), st.booleans())
def test_identity_experts_split_over_tp_equal_the_serial_layer(seed: int, sp: bool) -> None:
    """tp=2 (``split_hidden``), with or without sequence parallelism: the identity share is
    added once (on the group's first rank), the router's gradient summed over tp is serial."""
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    serial = _serial(seed, x, g)
    runs = run_threaded(2, _tp_rank, seed, x, g, sp, timeout=60)
    for r, run in enumerate(runs):
        close_out(run["out"], serial["out"].chunk(2, dim=-2)[r] if sp else serial["out"])
        want_x = serial["x_grad"].chunk(2, dim=-2)[r] if sp else serial["x_grad"]
        close_out(run["x_grad"], want_x)
    router = torch.stack([run["grads"]["router.weight"] for run in runs]).sum(0)
    close_grad(router, serial["grads"]["router.weight"])
    w2 = torch.cat([run["grads"]["experts.w2"] for run in runs], dim=1)
    close_grad(w2, serial["grads"]["experts.w2"])


# ---------------------------------------------------------------------------- post-norm
def _normed_layer(seed: int) -> MoE:
    layer = MoE(8, 6, 4, 2, shared_hidden=4, post_norm_eps=1e-6, seed=seed)
    assert layer.post_norm is not None
    with torch.no_grad():  # a weight of its own, so that a norm left unweighted would show
        layer.post_norm.copy_(1 + 0.5 * torch.randn(8, generator=torch.Generator().manual_seed(seed)))
    return layer


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31))
def test_a_post_norm_normalises_the_mixtures_output(seed: int) -> None:
    layer = _normed_layer(seed)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed + 1))
    got = layer(x)
    assert layer.post_norm is not None
    weight, layer.post_norm = layer.post_norm, None  # the mixture alone
    mixed = layer(x)
    want = weight * mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + 1e-6)
    close_out(got, want)


def _normed_tp_rank(rank: int, seed: int, x: Tensor, g: Tensor, sp: bool) -> dict[str, Any]:
    group = _world()
    layer = split_hidden(_normed_layer(seed), group, sequence_parallel=sp)
    mine = (x.chunk(2, dim=-2)[rank] if sp else x).clone().requires_grad_()
    out = layer(mine)
    whole = gather_along(out, -2, group) if sp else out  # the caller's loss is the same on every rank
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((whole * g).sum(), [mine, *params.values()])
    return {"out": out.detach(), "x_grad": grads[0], "grads": dict(zip(params, grads[1:], strict=True))}


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31), st.booleans())
@example(7327019, False)  # the largest round-off measured (the bound in the docstring)
def test_a_post_norm_split_over_tp_equals_the_serial_layer(seed: int, sp: bool) -> None:
    """tp=2: with sequence parallelism each rank normalises its slice (the norm's gradient a
    partial sum over the slices), without it every rank the whole output (its gradient from its
    own share of the tokens); summed over the ranks, the norm's and the router's gradients are
    serial. Outputs and input gradients atol 5e-6: the norm divides by the RMS of the mixture's
    output, which on these weights falls to about 0.1, so the round-off of the tp sum (1e-7 of
    the mixture's scale) grows up to tenfold (measured 1.5e-6 at seed 7327019)."""
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    serial = _normed_layer(seed)
    xs = x.clone().requires_grad_()
    out = serial(xs)
    params = dict(serial.named_parameters())
    grads = torch.autograd.grad((out * g).sum(), [xs, *params.values()])
    x_grad, want = grads[0], dict(zip(params, grads[1:], strict=True))
    runs = run_threaded(2, _normed_tp_rank, seed, x, g, sp, timeout=60)
    close_normed = partial(torch.testing.assert_close, rtol=1e-5, atol=5e-6)
    for r, run in enumerate(runs):
        close_normed(run["out"], out.detach().chunk(2, dim=-2)[r] if sp else out.detach())
        close_normed(run["x_grad"], x_grad.chunk(2, dim=-2)[r] if sp else x_grad)
    for name in ("post_norm", "router.weight"):
        close_grad(torch.stack([run["grads"][name] for run in runs]).sum(0), want[name])


def _two_gathers(rank: int) -> str:
    group = _world()
    try:
        split_hidden(_normed_layer(0), group, gathers=[(-1, group), (-2, group)])
    except ValueError as e:
        return str(e)
    return ""


def test_a_post_norm_is_refused_where_tp_leaves_a_block_of_the_hidden() -> None:
    for message in run_threaded(2, _two_gathers, timeout=60):
        assert "a post-norm needs each token's whole hidden after the layer, but 2 gathers" in message


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan")])
def test_a_bad_post_norm_epsilon_is_refused_naming_it(eps: float) -> None:
    with pytest.raises(ValueError, match=rf"post_norm_eps must be finite and > 0 \(or None\), got {eps}"):
        MoE(4, 4, 4, 2, post_norm_eps=eps, seed=0)
