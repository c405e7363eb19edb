"""`OutputBiasMoE`: an `MoE` plus one trained output bias (JetMoE's), serial and split over tp.

Tier 0: the output is the mixture's plus the bias; a post-norm is refused. Tier 1 (threaded
ranks): split over tp=2 (``split_hidden``), with sequence parallelism (each rank adds the bias
to its slice) and without (every rank holds the whole output; the bias's gradient on the first
rank, zeros on the other, so that every rank has one to sum), each rank's output and input
gradient are the serial layer's, and the bias's and router's gradients summed over tp are the
serial ones; 2D-style gathers (a block of the hidden per rank) are refused at the first call.

Tolerances as ``test_moe_routing_options.py``'s: outputs and input gradients rtol 1e-5, atol
1e-6, parameter gradients rtol 1e-5, atol 1e-5 (sums over tokens and over tp in another order).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributed import ProcessGroup

from tessera.comm import gather_along
from tessera.comm.testing import run_threaded
from tessera.moe import MoE, split_hidden
from tessera.moe.output_bias import OutputBiasMoE

close_out = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)  # outputs, input gradients
close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # parameter gradients


def _layer(seed: int) -> OutputBiasMoE:
    layer = OutputBiasMoE(8, 6, 4, 2, shared_hidden=4, seed=seed)
    with torch.no_grad():  # a bias of its own, so that a bias left out would show
        layer.bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(seed)))
    return layer


def test_the_output_is_the_mixtures_plus_the_bias() -> None:
    layer = _layer(3)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
    plain = MoE(8, 6, 4, 2, shared_hidden=4, seed=3)
    close_out(layer(x), plain(x) + layer.bias)
    assert not torch.allclose(layer(x), plain(x))


def test_a_post_norm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"OutputBiasMoE takes no post-norm \(post_norm_eps=1e-06\)"):
        OutputBiasMoE(8, 6, 4, 2, post_norm_eps=1e-6, seed=0)


def _world() -> ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


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
def test_an_output_bias_split_over_tp_equals_the_serial_layer(seed: int, sp: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    serial = _layer(seed)
    xs = x.clone().requires_grad_()
    out = serial(xs)
    params = dict(serial.named_parameters())
    grads = torch.autograd.grad((out * g).sum(), [xs, *params.values()])
    x_grad, want = grads[0], dict(zip(params, grads[1:], strict=True))
    runs = run_threaded(2, _tp_rank, seed, x, g, sp, timeout=60)
    for r, run in enumerate(runs):
        close_out(run["out"], out.detach().chunk(2, dim=-2)[r] if sp else out.detach())
        close_out(run["x_grad"], x_grad.chunk(2, dim=-2)[r] if sp else x_grad)
    for name in ("bias", "router.weight"):
        close_grad(torch.stack([run["grads"][name] for run in runs]).sum(0), want[name])
    if not sp:  # the same whole output on both ranks: the bias's gradient on the first one only
        assert torch.count_nonzero(runs[1]["grads"]["bias"]) == 0


def _two_gathers(rank: int) -> str:
    group = _world()
    layer = split_hidden(_layer(0), group, gathers=[(-1, group)])
    layer.gathers = ((-1, group), (-2, group))  # as a 2D grid's: a block of the hidden per rank
    try:
        layer(torch.zeros(2, 4, 4))
    except ValueError as e:
        return str(e)
    return ""


def test_a_block_of_the_hidden_per_rank_is_refused() -> None:
    for message in run_threaded(2, _two_gathers, timeout=60):
        assert "OutputBiasMoE under 2 gathers (2D, 2.5D or 3D tensor parallelism" in message
