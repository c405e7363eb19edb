"""Tier 1: tensor parallelism inside the experts (`split_hidden`) against the serial layer.

Every tp rank builds the same serial layer (same seed) and keeps its share of every
expert's hidden units, and of the shared expert's. The ranks then run the same batch
``x [B, S, d]`` (with sequence parallelism each rank its slice of the sequence); the loss on
every rank is the serial one, ``sum(out * g) + a * aux + b * z``, with the losses either
added by the caller or trained from inside the layer (``aux_loss_coef``), as an engine's
tp ranks all compute one loss. Each rank must give the serial output (its slice under SP)
and the serial input gradient; summed over the ranks, the gradients of the router and the
shared gate must be the serial ones (they are partial sums: the layer is a tp region); each
rank's expert gradients must be its hidden slice of the serial ones. Hypothesis draws tp
(2, 4), experts, top-k, capacity or drop-less, the activation, a shared expert with or
without its gate, and the coefficients.

Tolerances, fp32: outputs and input gradients rtol 1e-5, atol 1e-6 (each output is the sum
over tp of partial expert outputs, at most 8 terms of order 1 added in another order);
parameter gradients rtol 1e-5, atol 1e-5 (sums over up to 32 rows, per rank then over ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import gather_along
from tessera.comm.testing import run_threaded
from tessera.moe import MoE, split_hidden

OUT = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-5, "atol": 1e-5}
SPLIT = {"experts.w1": 2, "experts.w3": 2, "experts.w2": 1, "shared.w1": 2, "shared.w3": 2, "shared.w2": 1}


def _loss(layer: MoE, out: Tensor, g: Tensor, coefs: tuple[float, float], inside: bool) -> Tensor:
    loss = (out * g).sum()
    if not inside:
        loss = loss + coefs[0] * layer.aux_loss + coefs[1] * layer.z_loss
    return loss


def _build(config: dict[str, Any], coefs: tuple[float, float], inside: bool) -> MoE:
    extra = {"aux_loss_coef": coefs[0], "z_loss_coef": coefs[1]} if inside else {}
    return MoE(**config, **extra)


def _serial(
    config: dict[str, Any], x: Tensor, g: Tensor, coefs: tuple[float, float], inside: bool
) -> dict[str, Any]:
    layer = _build(config, coefs, inside)
    x = x.clone().requires_grad_()
    out = layer(x)
    _loss(layer, out, g, coefs, inside).backward()
    assert x.grad is not None
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads, "aux": float(layer.aux_loss)}


def _tp_rank(
    rank: int,
    config: dict[str, Any],
    x: Tensor,
    g: Tensor,
    coefs: tuple[float, float],
    inside: bool,
    sp: bool,
) -> dict[str, Any]:
    group = dist.group.WORLD
    tp = dist.get_world_size()
    layer = split_hidden(_build(config, coefs, inside), group, sequence_parallel=sp)
    mine = x.chunk(tp, dim=-2)[rank] if sp else x
    mine = mine.clone().requires_grad_()
    out = layer(mine)
    whole = gather_along(out, -2, group) if sp else out  # the caller's loss is the same on every rank
    _loss(layer, whole, g, coefs, inside).backward()
    assert mine.grad is not None
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x_grad": mine.grad, "grads": grads, "aux": float(layer.aux_loss)}


def check(serial: dict[str, Any], runs: list[dict[str, Any]], sp: bool) -> None:
    tp = len(runs)
    for r, run in enumerate(runs):
        want_out = serial["out"].chunk(tp, dim=-2)[r] if sp else serial["out"]
        want_x = serial["x_grad"].chunk(tp, dim=-2)[r] if sp else serial["x_grad"]
        torch.testing.assert_close(run["out"], want_out, **OUT, msg=lambda m, r=r: f"rank {r} output: {m}")
        torch.testing.assert_close(
            run["x_grad"], want_x, **OUT, msg=lambda m, r=r: f"rank {r} input grad: {m}"
        )
        assert run["aux"] == pytest.approx(serial["aux"], rel=1e-5), (r, run["aux"], serial["aux"])
    for name, want in serial["grads"].items():
        if name in SPLIT:
            got = torch.cat([run["grads"][name] for run in runs], dim=SPLIT[name])
        else:  # whole on every rank, a partial sum on each
            got = torch.stack([run["grads"][name] for run in runs]).sum(0)
        torch.testing.assert_close(got, want, **GRAD, msg=lambda m, n=name: f"{n}: {m}")
    assert set(runs[0]["grads"]) == set(serial["grads"]), (sorted(runs[0]["grads"]), sorted(serial["grads"]))


@st.composite
def tp_cases(draw: st.DrawFn) -> tuple[dict[str, Any], int, tuple[float, float], bool, bool, int]:
    tp = draw(st.sampled_from([2, 4]))
    experts = draw(st.integers(1, 4))
    shared = draw(st.sampled_from([None, tp, 2 * tp]))
    config = {
        "d_model": draw(st.sampled_from([4, 8])),
        "hidden": tp * draw(st.integers(1, 3)),
        "experts": experts,
        "top_k": draw(st.integers(1, experts)),
        "activation": draw(st.sampled_from(["swiglu", "gelu"])),
        "capacity_factor": draw(st.sampled_from([None, 0.5, 1.0, 2.0])),
        "shared_hidden": shared,
        "shared_gate": shared is not None and draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }
    coefs = (draw(st.sampled_from([0.0, 0.1])), draw(st.sampled_from([0.0, 0.01])))
    return config, tp, coefs, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31))


@settings(max_examples=40, deadline=None)
@given(tp_cases())
def test_experts_split_over_tp_equal_the_serial_layer(
    case: tuple[dict[str, Any], int, tuple[float, float], bool, bool, int],
) -> None:
    config, tp, coefs, inside, sp, seed = case
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, 2 * tp
    x = 1.0 + 0.3 * torch.randn(batch, seq, config["d_model"], generator=gen)
    g = torch.randn(batch, seq, config["d_model"], generator=gen)
    serial = _serial(config, x, g, coefs, inside)
    runs = run_threaded(tp, _tp_rank, config, x, g, coefs, inside, sp, timeout=60)
    check(serial, runs, sp)


def _uneven(rank: int) -> str:
    layer = MoE(4, 6, 2, 1, shared_hidden=3, seed=1)
    before = layer.experts.w1.detach().clone()
    try:
        split_hidden(layer, dist.group.WORLD)
    except ValueError as e:
        assert torch.equal(layer.experts.w1, before) and layer.tp_group is None  # nothing changed
        return str(e)
    return ""


def test_a_hidden_width_tp_does_not_divide_is_refused_naming_it() -> None:
    message = run_threaded(4, _uneven)[0]
    assert "tp=4 must divide the hidden width of every expert: experts hidden 6, shared hidden 3" in message
