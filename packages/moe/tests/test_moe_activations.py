"""Tier 0: the experts' activations (`tessera.moe.activations`): ReLU² (non-gated) and the
clamped and softcapped `SwiGLUVariant`, each against a plain-torch reference written from its
definition; a bank computing them split over its hidden units (as tensor parallelism splits
it) sums, share by share, to the whole bank's output; bad settings are refused naming them.

Bounds: the same operations in the same order are compared exactly (``rtol=0, atol=0``); a bank
against its split shares rtol 1e-5, atol 1e-6 (fp32, the hidden units' sum in another order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.moe import ClampedSwiGLU, Experts, MoE, SwiGLUVariant
from tessera.moe.activations import activate, is_gated

EXACT: dict[str, Any] = {"rtol": 0.0, "atol": 0.0}
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


def _pair(seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 10, generator=gen) * 2, torch.randn(6, 10, generator=gen) * 2


def test_relu2_is_relu_squared_and_not_gated() -> None:
    gate, _ = _pair()
    assert not is_gated("relu2") and not is_gated("gelu") and is_gated("swiglu")
    want = torch.where(gate > 0, gate * gate, torch.zeros_like(gate))
    torch.testing.assert_close(activate("relu2", gate, None), want, **EXACT)
    with pytest.raises(ValueError, match="'swiglu' needs an up projection"):
        activate("swiglu", gate, None)


def test_a_plain_variant_is_swiglu_and_gpt_osss_is_the_clamped_one() -> None:
    gate, up = _pair(1)
    torch.testing.assert_close(SwiGLUVariant()(gate, up), F.silu(gate) * up, **EXACT)
    clamped = SwiGLUVariant(alpha=1.702, gate_limit=0.5, up_limit=0.5, up_offset=1.0)
    torch.testing.assert_close(clamped(gate, up), ClampedSwiGLU(1.702, 0.5)(gate, up), **TOL)


def test_each_clamp_and_softcap_acts_where_its_definition_says() -> None:
    gate, up = _pair(2)
    g = gate.clamp(max=0.5)
    torch.testing.assert_close(  # HunYuan-V4: gate and up clamped before
        SwiGLUVariant(gate_limit=0.5, up_limit=0.4)(gate, up), F.silu(g) * up.clamp(-0.4, 0.4), **EXACT
    )
    torch.testing.assert_close(  # Ling: the activation clipped after
        SwiGLUVariant(act_limit=0.3, up_limit=0.3)(gate, up),
        F.silu(gate).clamp(max=0.3) * up.clamp(-0.3, 0.3),
        **EXACT,
    )
    cap = SwiGLUVariant(
        gate_softcap=0.5, up_softcap=0.7, float32=True
    )  # Inkling 2: the sigmoid sees the raw gate
    want = torch.tanh(gate / 0.5) * 0.5 * torch.sigmoid(gate) * (torch.tanh(up / 0.7) * 0.7)
    torch.testing.assert_close(cap(gate, up), want, **EXACT)
    gh, uh = gate.half(), up.half()  # in fp16: computed in fp32, then rounded once
    g32, u32 = gh.float(), uh.float()
    want = torch.tanh(g32 / 0.5) * 0.5 * torch.sigmoid(g32) * (torch.tanh(u32 / 0.7) * 0.7)
    torch.testing.assert_close(cap(gh, uh), want.half(), **EXACT)


@pytest.mark.parametrize("field", ["gate_limit", "up_limit", "act_limit", "gate_softcap", "up_softcap"])
def test_a_limit_or_softcap_that_is_not_positive_is_refused_naming_it(field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}': 0.0"):
        SwiGLUVariant(**{field: 0.0})  # type: ignore[arg-type]


def test_an_unknown_activation_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"one of \('swiglu', 'gelu', 'relu2', 'geglu_tanh'\), got 'relu'"):
        Experts(4, 6, "relu", seed=0, streams=[0])  # type: ignore[arg-type]


ACTS = [
    "relu2",
    SwiGLUVariant(gate_limit=0.5, up_limit=0.5),
    SwiGLUVariant(act_limit=0.3, up_limit=0.3),
    SwiGLUVariant(gate_softcap=0.5, up_softcap=0.3, float32=True),
]


@pytest.mark.parametrize("activation", ACTS, ids=str)
def test_a_bank_computes_its_activation_and_splits_over_its_hidden_units(activation: object) -> None:
    bank = Experts(8, 6, activation, seed=3, streams=[0, 1, 2])  # type: ignore[arg-type]
    assert (bank.w3 is None) == (activation == "relu2")
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(4)) * 3
    counts = torch.tensor([3, 0, 4])
    out = bank(x, counts)
    rows = torch.split(x, counts.tolist())
    for e, piece in enumerate(rows):  # the reference: each expert by its definition
        gate = piece @ bank.w1[e]
        hidden = activate(bank.activation, gate, None if bank.w3 is None else piece @ bank.w3[e])
        torch.testing.assert_close(out[sum(counts[:e].tolist()) :][: len(piece)], hidden @ bank.w2[e], **TOL)
    torch.testing.assert_close(bank(x, counts, grouped=False), out, **TOL)
    shares = []
    for rank in range(2):  # as split_hidden splits it over tp=2
        share = Experts(8, 6, activation, seed=3, streams=[0, 1, 2])  # type: ignore[arg-type]
        share.keep_hidden(rank * 3, (rank + 1) * 3)
        shares.append(share(x, counts))
    torch.testing.assert_close(shares[0] + shares[1], out, **TOL)


def test_a_layer_of_non_gated_experts_has_a_non_gated_shared_expert() -> None:
    layer = MoE(8, 6, 4, 2, activation="relu2", shared_hidden=5, seed=1)
    assert layer.experts.w3 is None and layer.shared is not None and layer.shared.w3 is None
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5))
    layer(x).sum().backward()
    assert layer.shared.w1.grad is not None and layer.experts.w1.grad is not None
