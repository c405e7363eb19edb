"""Tier 1: ring attention's block kernels, fused (torch's CPU flash attention) against unfused.

Both compute one (queries x keys) block's normalised output and log-sum-exp, and the block's
dq, dk, dv from a final output and log-sum-exp. The unfused path is the reference: separate
operators whose arithmetic the module docstring spells out. The ring's blocks are classified
here too: every block of the contiguous and zigzag layouts must be unmasked or exactly causal
(else it silently falls back to the slow path).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.tensor_parallel.context import kernels
from tessera.tensor_parallel.context.layout import Layout, local_positions
from tessera.tensor_parallel.context.ring import _Block

pytestmark = pytest.mark.skipif(not kernels.fused_available(), reason="no CPU flash-attention kernel")

# fp32, unit-scale inputs, at most 24 keys: the fused kernel sums the softmax in tiles and in
# another order than the unfused operators; outputs and gradients are O(1) and measured to
# differ by under 1e-6; a wrong scale, mask or lse is off by O(0.1).
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_FUSED", False)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    rows=st.integers(1, 24),
    cols=st.integers(1, 24),
    dim=st.sampled_from([3, 8, 16]),
    causal=st.booleans(),
    seed=st.integers(0, 99),
)
def test_fused_equals_unfused(
    batch: int, heads: int, rows: int, cols: int, dim: int, causal: bool, seed: int
) -> None:
    """Forward out and lse, then backward from a final out/lse that differs from the block's
    own (as after merging other blocks), both ways; causal blocks are square."""
    cols = rows if causal else cols
    gen = torch.Generator().manual_seed(seed)
    q, dout, out = (torch.randn(batch, heads, rows, dim, generator=gen) for _ in range(3))
    k, v = (torch.randn(batch, heads, cols, dim, generator=gen) for _ in range(2))
    lse = torch.randn(batch, heads, rows, 1, generator=gen) + 3.0  # as if other keys added mass
    mask = torch.ones(rows, rows, dtype=torch.bool).tril() if causal else None
    scale = 1 / math.sqrt(dim)
    delta = (dout * out).sum(-1, keepdim=True)
    assert kernels.use_fused(q, mask, causal)
    fused = (
        *kernels.block_forward(q, k, v, mask, causal, scale),
        *kernels.block_backward(q, k, v, out, lse, dout, delta, mask, causal, scale),
    )
    with pytest.MonkeyPatch.context() as mp:
        _unfused(mp)
        assert not kernels.use_fused(q, mask, causal)
        plain = (
            *kernels.block_forward(q, k, v, mask, causal, scale),
            *kernels.block_backward(q, k, v, out, lse, dout, delta, mask, causal, scale),
        )
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), fused, plain, strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_general_mask_takes_the_unfused_path() -> None:
    q = torch.zeros(1, 1, 3, 4)
    mask = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    assert not kernels.use_fused(q, mask, False)
    assert kernels.use_fused(q, None, False)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_every_ring_block_is_unmasked_or_causal(layout: Layout, sp: int) -> None:
    """Causal attention over both layouts: each block with work is full or exactly causal, and
    the causal flag is set exactly on the masked ones (so every block takes the fused kernel)."""
    local = 2 * 4
    positions = [local_positions(r, sp, local, layout) for r in range(sp)]
    for r in range(sp):
        for s in range(sp):
            block = _Block.between(positions[r], positions[s])
            if block is None:
                continue
            assert block.causal == (block.mask is not None), (layout, sp, r, s, block.mask)
            if block.mask is not None:
                assert torch.equal(block.mask, torch.ones_like(block.mask).tril())
