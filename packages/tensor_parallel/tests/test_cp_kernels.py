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
# another order than the unfused operators. Outputs are O(1), but the backward takes a final
# lse drawn at random, which can lie below the block's own: its probabilities then reach ~30
# and its gradients ~100 (seen: rows = cols = 22, dim 3), and both kernels differ from a
# float64 run by up to ~5e-7 of the tensor's largest element (dq: 4.8e-5 fused, 2.0e-5
# unfused, at a largest |dq| of 101). So the absolute tolerance scales with that element
# (``_close``); a wrong scale, mask or lse is off by O(0.1) of it.
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    atol = TOL["atol"] * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=TOL["rtol"], atol=atol, msg=lambda m: f"{name}: {m}")


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
    mask = None  # causal: the triangle is implied
    scale = 1 / math.sqrt(dim)
    delta = (dout * out).sum(-1, keepdim=True)
    assert kernels.use_fused(q, mask)
    fused = (
        *kernels.block_forward(q, k, v, mask, causal, scale),
        *kernels.block_backward(q, k, v, out, lse, dout, delta, mask, causal, scale),
    )
    with pytest.MonkeyPatch.context() as mp:
        _unfused(mp)
        assert not kernels.use_fused(q, mask)
        plain = (
            *kernels.block_forward(q, k, v, mask, causal, scale),
            *kernels.block_backward(q, k, v, out, lse, dout, delta, mask, causal, scale),
        )
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), fused, plain, strict=True):
        _close(got, want, name)


def test_general_mask_takes_the_unfused_path() -> None:
    q = torch.zeros(1, 1, 3, 4)
    mask = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    assert not kernels.use_fused(q, mask)
    assert kernels.use_fused(q, None)


def test_an_explicit_causal_mask_equals_the_causal_flag() -> None:
    """The unfused path's general mask, set to the triangle, gives what ``causal`` gives."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen) for _ in range(3))
    tri = torch.ones(5, 5, dtype=torch.bool).tril()
    with pytest.MonkeyPatch.context() as mp:
        _unfused(mp)
        got = kernels.block_forward(q, k, v, tri, False, 0.5)
    want = kernels.block_forward(q, k, v, None, True, 0.5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_ring_block_is_full_or_causal(layout: Layout, cp: int) -> None:
    """Causal attention over both layouts: the block the ring works out from 1-D positions
    (kept rows, columns, all pairs / causal triangle) equals the explicit (query x key)
    comparison, and no block needs a general mask (so every one takes the fused kernel)."""
    local = 2 * 4
    positions = [local_positions(r, cp, local, layout) for r in range(cp)]
    for r in range(cp):
        for s in range(cp):
            allowed = positions[s][None, :] <= positions[r][:, None]
            block = _Block.between(positions[r], positions[s])
            if block is None:
                assert not bool(allowed.any()), (layout, cp, r, s)
                continue
            rows = torch.arange(local) if block.rows is None else block.rows
            cols = torch.arange(local) if block.cols is None else block.cols
            assert torch.equal(rows, allowed.any(1).nonzero().squeeze(1)), (layout, cp, r, s)
            assert torch.equal(cols, allowed.any(0).nonzero().squeeze(1)), (layout, cp, r, s)
            kept = allowed[rows][:, cols]
            implied = torch.ones_like(kept).tril() if block.causal else torch.ones_like(kept)
            assert block.mask() is None, (layout, cp, r, s)
            assert torch.equal(kept, implied), (layout, cp, r, s, kept)


def test_a_general_block_keeps_its_mask() -> None:
    """Positions that are neither all-allowed nor the triangle (not a layout the ring makes)."""
    block = _Block.between(torch.tensor([1, 5]), torch.tensor([0, 2, 4]))
    assert block is not None and not block.causal
    assert torch.equal(block.mask(), torch.tensor([[True, False, False], [True, True, True]]))


def test_the_kernel_table() -> None:
    """Which kernel a block gets, by device type, dtype, head dim and mask (a pure function of
    them: no device is faked). CUDA kernels only on CUDA, in the dtypes and head dims they take."""
    choose = kernels.choose
    assert choose("cpu", torch.float32, 64, masked=False) == "cpu-flash"
    assert choose("cpu", torch.float32, 64, masked=False, cpu_fused=False) == "unfused"
    assert choose("cuda", torch.bfloat16, 64, masked=False) == "cuda-flash"
    assert choose("cuda", torch.float16, 128, masked=False) == "cuda-flash"
    assert choose("cuda", torch.float32, 64, masked=False) == "cuda-efficient"
    assert choose("cuda", torch.bfloat16, 12, masked=False) == "unfused"  # flash: a multiple of 8
    assert choose("cuda", torch.float32, 6, masked=False) == "unfused"  # efficient: a multiple of 4
    assert choose("cuda", torch.float32, 512, masked=False) == "unfused"
    assert choose("cuda", torch.float64, 64, masked=False) == "unfused"
    assert choose("cuda", torch.bfloat16, 64, masked=True) == "unfused"
    assert choose("mps", torch.float32, 64, masked=False) == "unfused"
    assert choose("meta", torch.float32, 64, masked=False) == "unfused"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this run has CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cuda_less_run_never_takes_a_cuda_kernel(dtype: torch.dtype) -> None:
    """On a machine without CUDA every tensor is a CPU tensor: the CPU kernel where torch has
    it, the unfused path otherwise or under a mask, never a CUDA kernel."""
    q = torch.zeros(1, 2, 8, 16, dtype=dtype)
    assert kernels.kernel(q, None) == "cpu-flash"
    assert kernels.kernel(q, torch.ones(8, 8, dtype=torch.bool)) == "unfused"
    with pytest.MonkeyPatch.context() as mp:
        _unfused(mp)
        assert kernels.kernel(q, None) == "unfused"


@pytest.mark.parametrize("which", ["cuda-flash", "cuda-efficient"])
def test_the_cuda_calls_fit_their_schemas(which: kernels.Kernel) -> None:
    """The CUDA kernels' calls, run on the meta device (torch's shape functions of those ops):
    arguments accepted, output and fp32 log-sum-exp of the block's shape (40 rows: not a
    multiple of the efficient kernel's 32-row padding), gradients of q's, k's, v's shapes. The
    values are checked on a GPU by ``benchmarks/gpu`` (``cp-kernels``)."""
    dtype = torch.bfloat16 if which == "cuda-flash" else torch.float32
    q = torch.empty(2, 3, 40, 64, device="meta", dtype=dtype)
    k = v = torch.empty(2, 3, 24, 64, device="meta", dtype=dtype)
    out, lse = kernels._cuda_forward(which, q, k, v, False, 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 3, 40, 1) and lse.dtype == torch.float32
    final = torch.empty(2, 3, 40, 64, device="meta")  # the merged output is fp32 in the ring
    grads = kernels._cuda_backward(which, q, k, v, final, lse, final, False, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_a_bf16_block_takes_a_final_output_in_fp32() -> None:
    """The ring merges in fp32: a bf16 block's backward gets an fp32 final output, gradient and
    log-sum-exp, and the fused kernel (which wants them in the block's dtype) is given them so.
    Against the unfused path in fp32 on the same bf16-rounded inputs: 4e-2 of the largest
    gradient (bf16 keeps 8 mantissa bits; measured ~5e-3), where a wrong lse is off by ~0.5."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout, out = (torch.randn(1, 2, 16, 32, generator=gen) for _ in range(5))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    q32, k32, v32 = (t.float() for t in (qb, kb, vb))
    lse = kernels.block_forward(q32, k32, v32, None, True, 0.2, which="unfused")[1] + math.log(2.0)
    delta = (dout * out).sum(-1, keepdim=True)
    got = kernels.block_backward(qb, kb, vb, out, lse, dout, delta, None, True, 0.2)
    want = kernels.block_backward(q32, k32, v32, out, lse, dout, delta, None, True, 0.2, which="unfused")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert float((g.float() - w).abs().max() / w.abs().max()) < 4e-2
