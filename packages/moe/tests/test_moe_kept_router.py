"""Tiers 0 and 1: a router kept as its model wrote it (`tessera.moe.KeptRouter`) in an `MoE`
layer: a toy router module (an MLP scoring ``E + 1`` classes, the last a skip class mapped to
expert 0 with weight 0 as ZAYA's router maps it, and a state carried to the next call) read by an
adapter; the layer's dispatch against a token-by-token loop written here, serially and at ep=2
(threaded); what an adapter gives wrongly is refused naming the shapes.

Tolerances: outputs and input gradients rtol 1e-5, atol 1e-6, parameter gradients rtol 1e-5,
atol 1e-5 (the same fp32 products summed in another order: per expert batched against token by
token, per rank then over ranks), as ``test_moe_ep.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.moe import KeptChoice, KeptRouter, MoE

close_out = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)  # outputs, input gradients
close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # parameter gradients
D, H, E, K = 8, 6, 4, 2


class ToyRouter(nn.Module):
    """Scores ``E`` experts and a skip class (the last) by a two-layer MLP of ``x`` plus a carried
    state ``[.., D]``; top-k of the softmax, a skip choice mapped to expert 0 with weight 0."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc = nn.Parameter(torch.randn(D, D, generator=gen) * 0.5)
        self.out = nn.Parameter(torch.randn(E + 1, D, generator=gen))
        self.register_buffer("bias", torch.zeros(E + 1))

    def forward(self, x: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h = torch.tanh(x @ self.fc.t()) + (0 if state is None else state)
        logits = (h @ self.out.t()).reshape(-1, E + 1)
        probs = torch.softmax(logits, dim=-1)
        choices = torch.topk(probs.detach() + self.bias, K, dim=-1).indices
        weights = probs.gather(1, choices)
        skip = choices == E
        return logits, weights.masked_fill(skip, 0), choices.masked_fill(skip, 0), h


def adapt(module: nn.Module, x: Tensor, carried: Any) -> KeptChoice:
    logits, weights, choices, state = module(x, carried)
    return KeptChoice(choices, weights, logits, state)


def _layer(seed: int, ep_group: dist.ProcessGroup | None = None) -> MoE:
    layer = MoE(D, H, E, K, seed=seed, ep_group=ep_group)
    layer.router = KeptRouter(ToyRouter(seed), adapt, E, K)  # type: ignore[assignment]
    with torch.no_grad():  # some tokens choose the skip class
        layer.router.module.bias[E] = 0.3  # type: ignore[index]
    return layer


def _reference(layer: MoE, x: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Token by token: the toy router's choices and weights, ``down(silu(x w1) * (x w3))`` per expert."""
    router: Any = layer.router.module
    experts = layer.experts
    assert experts.w3 is not None
    _, weights, choices, h = router(x, state)
    outs = []
    for t, w_t, c_t in zip(x.reshape(-1, D), weights, choices, strict=True):
        y = sum(
            w * ((F.silu(t @ experts.w1[e]) * (t @ experts.w3[e])) @ experts.w2[e])
            for w, e in zip(w_t, c_t.tolist(), strict=True)
        )
        outs.append(y)
    return torch.stack(outs).reshape(x.shape), h  # type: ignore[arg-type]


def _inputs(seed: int, batch: int = 3, seq: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq, D)
    return (
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen) * 0.1,
        torch.randn(shape, generator=gen),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_a_kept_router_layer_computes_the_token_by_token_loop(seed: int) -> None:
    """Outputs, the carried state, the input's and the state's gradients and every parameter's
    (the kept router's through its weights and the state it carries on) against the loop."""
    layer = _layer(seed)
    x, state, g = _inputs(seed)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    sa, sb = state.clone().requires_grad_(), state.clone().requires_grad_()
    got, routing = layer.forward_routed(xa, carried=sa)
    got_state = routing.carried
    assert got_state is not None
    assert bool((layer.router.module(x, state)[2] == 0).any())  # type: ignore[operator]
    (got * g).sum().add(got_state.square().sum()).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    want, want_state = _reference(layer, xb, sb)
    (want * g).sum().add(want_state.square().sum()).backward()
    close_out(got, want)
    close_out(got_state, want_state)
    close_out(xa.grad, xb.grad)
    close_out(sa.grad, sb.grad)
    assert set(grads) == {n for n, _ in layer.named_parameters()}
    assert {"router.module.fc", "router.module.out", "experts.w1"} <= set(grads)
    for n, p in layer.named_parameters():
        close_grad(grads[n], p.grad, msg=lambda m, n=n: f"{n}: {m}")


def test_the_kept_router_keeps_its_names_and_buffers() -> None:
    state = _layer(0).state_dict()
    assert {"router.module.fc", "router.module.out", "router.module.bias"} <= set(state)
    assert "router.weight" not in state


def _ep_rank(rank: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    layer = _layer(7, ep_group=dist.group.WORLD)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    (y * gs[rank]).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "first": layer.first_expert}


def test_expert_parallel_equals_the_serial_layer() -> None:
    """At ep=2 each rank's tokens give the serial layer's outputs on them; each rank's experts'
    gradients are the serial layer's on all tokens, the kept router's summed over ranks."""
    runs = [_inputs(10 + r, batch=2, seq=4 + r) for r in range(2)]
    xs, gs = [run[0] for run in runs], [run[2] for run in runs]
    got = run_threaded(2, _ep_rank, xs, gs, timeout=60)
    serial = _layer(7)
    x = torch.cat([t.reshape(-1, D) for t in xs]).requires_grad_()
    y = serial(x)
    (y * torch.cat([g.reshape(-1, D) for g in gs])).sum().backward()
    sizes = [t[..., 0].numel() for t in xs]
    ys, dxs = y.detach().split(sizes), x.grad.split(sizes)
    for r, run in enumerate(got):
        close_out(run["y"], ys[r].reshape(xs[r].shape))
        close_out(run["dx"], dxs[r].reshape(xs[r].shape))
        local = slice(run["first"], run["first"] + E // 2)
        for n in ("experts.w1", "experts.w2", "experts.w3"):
            close_grad(run["grads"][n], serial.get_parameter(n).grad[local], msg=lambda m, n=n: f"{n}: {m}")
    for n in ("router.module.fc", "router.module.out"):
        close_grad(sum(run["grads"][n] for run in got), serial.get_parameter(n).grad)


def test_what_an_adapter_gives_wrongly_is_refused_naming_the_shapes() -> None:
    layer = _layer(0)
    x, _, _ = _inputs(0)

    def one_choice(module: nn.Module, x: Tensor, carried: Any) -> KeptChoice:
        chose = adapt(module, x, carried)
        return KeptChoice(chose.choices[:, :1], chose.weights[:, :1], chose.logits)

    def narrow_logits(module: nn.Module, x: Tensor, carried: Any) -> KeptChoice:
        chose = adapt(module, x, carried)
        return KeptChoice(chose.choices, chose.weights, chose.logits[:, : E - 1])

    layer.router.adapter = one_choice  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"chose \(15, 1\) experts with weights \(15, 1\), not"):
        layer(x)
    layer.router.adapter = narrow_logits  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"gave logits \(15, 3\), not \[tokens, >= experts \(4\)\]"):
        layer(x)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, experts=4\], got 5"):
        KeptRouter(ToyRouter(0), adapt, E, 5)


def test_every_router_is_called_alike_and_says_what_its_experts_read() -> None:
    """A `TopKRouter` and a `KeptRouter` take the same call, ``(x, input_ids, tp_group=...,
    carried=...)`` on ``x [..., d]``, and give the experts' tokens (``x`` flattened) in their
    `Routing`; the kept one gives its module's state as ``carried``, the top-k one none."""
    x, state, _ = _inputs(3)
    for layer in (MoE(D, H, E, K, seed=3), _layer(3)):
        routing = layer.router(x, None, tp_group=None, carried=state)
        assert routing.inputs is not None
        assert torch.equal(routing.inputs, x.reshape(-1, D))
        assert routing.choices.shape == (15, K)
        assert (routing.carried is not None) == isinstance(layer.router, KeptRouter)
    whole = MoE(D, H, E, K, seed=3).router
    assert torch.equal(whole(x).weights, whole(x.reshape(-1, D)).weights)
