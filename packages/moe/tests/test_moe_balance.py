"""Auxiliary-loss-free balancing (`tessera.moe.balance`): the choice bias moved after each step
by ``bias_rate * sign(mean - load)``, the load counted once per trained call.

Counts are integers and the update is a sign, so every comparison here is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tessera.comm.testing import run_threaded
from tessera.moe import MoE, RouterSpec, balance_choice_biases, set_bias_rate

D, E, RATE = 8, 4, 0.25
SPEC = RouterSpec(score="sigmoid", choice_bias=True)


def _layer(rate: float = RATE) -> MoE:
    return MoE(d_model=D, hidden=6, experts=E, top_k=2, routing=SPEC, seed=3, bias_rate=rate)


def _tokens(seed: int, n: int = 5) -> Tensor:
    return torch.randn(2, n, D, generator=torch.Generator().manual_seed(seed))


def _want(layer: MoE, load: Tensor) -> Tensor:
    return RATE * torch.sign(load.mean() - load)


def test_the_bias_moves_against_the_load_of_every_trained_call() -> None:
    layer = _layer()
    load = torch.zeros(E, dtype=torch.float64)
    for seed in range(3):
        layer(_tokens(seed)).sum().backward()
        load += layer.stats.routed
    with torch.no_grad():  # an evaluation counts nothing
        layer(_tokens(9))
    assert balance_choice_biases(layer) == 1
    assert layer.router.score_bias is not None
    torch.testing.assert_close(layer.router.score_bias, _want(layer, load).float(), rtol=0, atol=0)
    assert layer.pending_load is None  # cleared for the next step
    moved = layer.router.score_bias.clone()
    layer(_tokens(4)).sum().backward()
    balance_choice_biases(layer, step=False)  # a skipped step: counts dropped, nothing moves
    assert torch.equal(layer.router.score_bias, moved) and layer.pending_load is None


def test_a_recomputed_call_counts_once() -> None:
    plain, recomputed = _layer(), _layer()
    x = _tokens(1).requires_grad_()
    plain(x).sum().backward()
    checkpoint(recomputed, x, use_reentrant=False).sum().backward()  # forward run twice
    assert plain.pending_load is not None and recomputed.pending_load is not None
    assert torch.equal(plain.pending_load, recomputed.pending_load)
    assert int(plain.pending_load.sum()) == x.shape[0] * x.shape[1] * 2  # every token's top-2


def _rank(rank: int, xs: list[Tensor]) -> Tensor:
    layer = _layer()
    layer(xs[rank]).sum().backward()
    balance_choice_biases(layer, dist.group.WORLD)
    assert layer.router.score_bias is not None
    return layer.router.score_bias


def test_replicas_sum_their_loads_and_move_alike() -> None:
    xs = [_tokens(10 + r) for r in range(2)]
    serial = _layer()
    for x in xs:
        serial(x).sum().backward()
    balance_choice_biases(serial)
    assert serial.router.score_bias is not None
    for bias in run_threaded(2, _rank, xs, timeout=60):
        torch.testing.assert_close(bias, serial.router.score_bias, rtol=0, atol=0)


def test_refusals_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"bias_rate=0\.1 needs a router with a choice bias"):
        MoE(d_model=D, hidden=6, experts=E, bias_rate=0.1, seed=0)
    with pytest.raises(ValueError, match="bias_rate must be >= 0, got -1"):
        MoE(d_model=D, hidden=6, experts=E, routing=SPEC, bias_rate=-1, seed=0)
    plain = MoE(d_model=D, hidden=6, experts=E, seed=0)
    with pytest.raises(ValueError, match="MoE has no MoE layer whose router holds a choice bias"):
        set_bias_rate(plain, 0.1)
    with pytest.raises(ValueError, match=r"bias_rate must be >= 0, got -0\.5"):
        set_bias_rate(_layer(0.0), -0.5)
    off = _layer(0.0)
    assert set_bias_rate(off, RATE) == 1 and off.bias_rate == RATE
    assert balance_choice_biases(plain) == 0  # nothing to balance: no collective either
