"""Tiers 0 and 1: per-expert output norms (`MoE`'s ``expert_norm_eps`` and ``shared_norm_eps``,
`Experts`' ``norm``: Ergo's ``post_expert_norm`` and its shared expert's norm), against a
token-by-token reference written here, serially (grouped and one expert at a time, with and
without capacity), under expert parallelism (ep=2, ranks as threads), and refused under tp.

Tolerances: the layer against the reference and the ep layer against the serial one, fp32
rtol 1e-5 and atol 1e-5 times the largest magnitude of the tensor compared (at least 1), for
outputs and every gradient. The norms scale the round-off up: each divides an expert's output
by its RMS, which falls to about 0.05 on these weights, so gradients reach about 70, and a few
products summed in another order differ by more than a fixed 1e-5 (as
``test_moe_routing_options.py`` allows) where they are large; measured over 3200 draws the worst
difference was 2.4e-6 of the tensor's largest magnitude (``shared.w1``; outputs 2.4e-7,
input gradients 1.1e-6).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributed import ProcessGroup

from tessera.comm.testing import run_threaded
from tessera.moe import Experts, MoE, RouterSpec, shard_experts, split_hidden
from tessera.moe.layer import hidden_split_problem


def close(got: Tensor, want: Tensor) -> None:
    """Outputs and gradients: round-off relative to the tensor's scale (module docstring)."""
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


EPS = 1e-6


def _layer(seed: int, *, activation: Any = "relu2", shared: bool = True, **extra: Any) -> MoE:
    """Ergo's mixture in small: sigmoid scores with a choice bias, scaled, ReLU² experts, each
    expert's output and the shared expert's normalised with weights drawn away from 1."""
    spec = RouterSpec(score="sigmoid", choice_bias=True, scale=2.5)
    layer = MoE(
        8,
        6,
        4,
        2,
        activation=activation,
        routing=spec,
        expert_norm_eps=EPS,
        shared_hidden=4 if shared else None,
        shared_norm_eps=EPS if shared else None,
        seed=seed,
        **extra,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        assert layer.experts.norm is not None and layer.router.score_bias is not None
        layer.experts.norm.copy_(1 + 0.5 * torch.randn(4, 8, generator=gen))
        layer.router.score_bias.copy_(0.1 * torch.randn(4, generator=gen))
        if layer.shared is not None:
            assert layer.shared.norm is not None
            layer.shared.norm.copy_(1 + 0.5 * torch.randn(1, 8, generator=gen))
    return layer


def _rms(y: Tensor, weight: Tensor) -> Tensor:
    return weight * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS)


def _mlp(bank: Experts, e: int, x: Tensor) -> Tensor:
    """Expert ``e`` of ``bank`` written out (no `Experts` code): ReLU² or SwiGLU."""
    h = x @ bank.w1[e]
    act = torch.relu(h).square() if bank.w3 is None else torch.nn.functional.silu(h) * (x @ bank.w3[e])
    return act @ bank.w2[e]


def _reference(layer: MoE, x: Tensor) -> Tensor:
    """Token by token: each chosen expert's output normalised with its own weight, weighed; the
    shared expert's normalised with its own."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    norm = layer.experts.norm
    assert norm is not None
    out = []
    for t, token in enumerate(tokens):
        y = torch.zeros_like(token)
        for w, e in zip(routing.weights[t], routing.choices[t].tolist(), strict=True):
            y = y + w * _rms(_mlp(layer.experts, e, token), norm[e])
        if layer.shared is not None:
            assert layer.shared.norm is not None
            y = y + _rms(_mlp(layer.shared, 0, token), layer.shared.norm[0])
        out.append(y)
    return torch.stack(out).view(x.shape)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["relu2", "swiglu"]), st.booleans(), st.booleans())
def test_each_experts_output_is_normalised_with_its_own_weight(
    seed: int, activation: str, shared: bool, grouped: bool
) -> None:
    layer = _layer(seed, activation=activation, shared=shared, grouped=grouped)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed + 1))
    g = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed + 2))
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = _reference(layer, x_ref), layer(x_got)
    close(got, want)
    params = [p for _, p in layer.named_parameters()]
    want_grads = torch.autograd.grad((want * g).sum(), [x_ref, *params], allow_unused=True)
    got_grads = torch.autograd.grad((got * g).sum(), [x_got, *params], allow_unused=True)
    close(got_grads[0], want_grads[0])
    for (name, _), a, b in zip(layer.named_parameters(), got_grads[1:], want_grads[1:], strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            close(a, b)


def test_the_norms_decide_the_output() -> None:
    """Without its norms (weights back to none) the layer computes something else on these
    inputs, and an expert's norm weight reaches only the rows routed to that expert."""
    layer = _layer(3)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = layer(x)
        norm, layer.experts.norm = layer.experts.norm, None
        assert not torch.allclose(layer(x), want, rtol=1e-5, atol=1e-6)
        layer.experts.norm = norm
    layer(x).sum().backward()
    assert layer.experts.norm is not None and layer.experts.norm.grad is not None
    chosen = set(layer.router(x.reshape(-1, 8)).choices.flatten().tolist())
    for e in range(4):
        assert bool(layer.experts.norm.grad[e].abs().sum() > 0) == (e in chosen)


def test_with_capacity_the_grouped_path_equals_the_loop() -> None:
    """Capacity 0.5 drops assignments, so the grouped batch is zero-padded: its padding rows
    normalise to zero and are never read back, and the grouped layer equals the one that runs
    each expert on its kept rows alone."""
    layer = _layer(5, capacity_factor=0.5, shared=False)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(6))
    got = layer(x)
    assert layer.stats.dropped_fraction > 0
    loop = _layer(5, capacity_factor=0.5, shared=False, grouped=False)
    close(got, loop(x))


def _world() -> ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _run(layer: MoE, x: Tensor, g: Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    out = layer(x)
    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((out * g).sum(), [x, *params.values()], allow_unused=True)
    kept = {n: grad for n, grad in zip(params, grads[1:], strict=True) if grad is not None}
    return {"out": out.detach(), "x_grad": grads[0], "grads": kept, "norm": params["experts.norm"].detach()}


def _ep_rank(rank: int, seed: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    return _run(shard_experts(_layer(seed), _world()), xs[rank], gs[rank])


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31))
def test_expert_norms_under_expert_parallelism_equal_the_serial_layer(seed: int) -> None:
    """ep=2: each rank holds its experts' norm rows (split with the bank) and normalises its
    experts' outputs before they travel back; each expert's norm gradient on its owner is the
    sum of the serial layer's over both ranks' tokens, the shared norm's a data-parallel one."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 5, 8, generator=gen) for _ in range(2)]
    gs = [torch.randn(2, 5, 8, generator=gen) for _ in range(2)]
    runs = run_threaded(2, _ep_rank, seed, xs, gs, timeout=60)
    serial = [_run(_layer(seed), x, g) for x, g in zip(xs, gs, strict=True)]
    norm = sum(s["grads"]["experts.norm"] for s in serial)
    for r, (run, want) in enumerate(zip(runs, serial, strict=True)):
        close(run["out"], want["out"])
        close(run["x_grad"], want["x_grad"])
        assert torch.equal(run["norm"], want["norm"][2 * r : 2 * r + 2])  # its experts' rows
        close(run["grads"]["experts.norm"], norm[2 * r : 2 * r + 2])
    for name in ("shared.norm", "router.weight"):
        close(sum(run["grads"][name] for run in runs), sum(s["grads"][name] for s in serial))


def _split(rank: int, shared_only: bool) -> str:
    layer = (
        MoE(8, 6, 4, 2, shared_hidden=4, shared_norm_eps=EPS, seed=0)
        if shared_only
        else _layer(0, shared=False)
    )
    try:
        split_hidden(layer, _world())
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("shared_only", [False, True])
def test_a_split_over_tp_is_refused_at_any_tp(shared_only: bool) -> None:
    """A norm of a partial sum is not the norm of the sum: ``split_hidden`` refuses either bank
    with a norm before changing anything, at any tp (the launcher then keeps the layer whole)."""
    bank = "shared" if shared_only else "experts"
    for message in run_threaded(2, _split, shared_only, timeout=60):
        assert f"the {bank} bank normalises each expert's output (per-expert RMS norm)" in message
    layer = _layer(0)
    assert "experts and shared bank normalises" in hidden_split_problem(layer, 1)
    assert hidden_split_problem(MoE(8, 6, 4, 2, shared_hidden=4, seed=0), 1) == ""
    with pytest.raises(ValueError, match="partial sum"):
        layer.experts.keep_hidden(0, 3)
    assert layer.experts.w1.shape == (4, 8, 6)  # nothing changed


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan")])
def test_a_bad_norm_epsilon_is_refused_naming_it(eps: float) -> None:
    with pytest.raises(
        ValueError, match=rf"an expert norm's epsilon must be finite and > 0 \(or None\), got {eps}"
    ):
        MoE(4, 4, 4, 2, expert_norm_eps=eps, seed=0)
    with pytest.raises(ValueError, match="needs a shared expert"):
        MoE(4, 4, 4, 2, shared_norm_eps=1e-6, seed=0)
