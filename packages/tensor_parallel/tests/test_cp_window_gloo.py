"""Sliding-window attention under ring and Ulysses attention, against serial attention.

Every rank keeps its slice of q, k, v (``split_batch``), runs ring or Ulysses attention with
a ``window`` forward and backward, and the reassembled out, dq, dk, dv are compared with
``F.scaled_dot_product_attention`` of the whole sequence under the band mask (a query sees
the keys less than ``window`` positions before it, itself included). Tolerance as
``test_cp_attention_gloo`` (fp32: blocks merged by the log-sum-exp rule, a few ulp on O(1)
values); a window applied on the local sequence only, or not at all, is off by O(0.1).
The pure tests check which ring blocks have work: a block wholly outside the window is
skipped (no arithmetic), one wholly inside it runs unmasked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm.testing.fixtures import PoolFactory
from tessera.tensor_parallel.context import (
    ring_attention,
    split_batch,
    ulysses_attention,
    unsplit_sequence,
)
from tessera.tensor_parallel.context.intercept import causal_of
from tessera.tensor_parallel.context.ring import _Block

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _band(seq: int, window: int) -> Tensor:
    back = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    return (back >= 0) & (back < window)


def _attend(rank: int, mode: str, layout: str, window: int, tensors: list[Tensor]) -> list[Tensor]:
    q, k, v, dout = split_batch(*tensors, group=None, layout=layout, dim=2)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    fn = ring_attention if mode == "ring" else ulysses_attention
    out = fn(q, k, v, group=None, causal=True, layout=layout, window=window)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


def _serial(tensors: list[Tensor], window: int) -> list[Tensor]:
    q, k, v, dout = tensors
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    mask = _band(q.shape[2], window)
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    )
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@settings(max_examples=6)
@given(window=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_a_sliding_window_equals_serial_attention_under_its_band(
    worker_pools: PoolFactory, mode: str, layout: str, window: int, seed: int
) -> None:
    cp, seq = 2, 32  # 8 or 16 tokens a block: windows shorter, equal and longer than a block
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, seq, 8), (2, 2, seq, 8), (2, 2, seq, 8), (2, 4, seq, 8)]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    parts = worker_pools(cp).run(_attend, mode, layout, window, tensors)
    got = [unsplit_sequence([p[i] for p in parts], layout=layout, dim=2) for i in range(4)]
    for g, w in zip(got, _serial(tensors, window), strict=True):  # out, dq, dk, dv
        torch.testing.assert_close(g, w, **TOL)


def test_ring_skips_the_blocks_outside_the_window() -> None:
    late, early = torch.arange(16, 24), torch.arange(0, 8)
    assert _Block.between(late, early, window=8) is None  # every key 9+ positions back: no work
    near = _Block.between(late, torch.arange(8, 16), window=16)  # every pair inside: unmasked
    assert near is not None and near.mask() is None and near.rows is None and near.cols is None
    part = _Block.between(late, torch.arange(8, 16), window=4)  # keys 13..15 reach queries 16..18
    assert part is not None and part.rows is not None and part.rows.tolist() == [0, 1, 2]
    assert part.cols is not None and part.cols.tolist() == [5, 6, 7]
    mask = part.mask()
    assert mask is not None and mask.sum().item() == 6  # (16,13..15), (17,14..15), (18,15)
    assert _Block.between(late, early, window=None) is not None  # causal alone: all of it


def test_a_local_band_mask_is_read_as_its_window() -> None:
    """Hugging Face builds the window's mask on the local sequence: the intercept reads it as
    causal within that window (and refuses a band of another width)."""
    band = _band(8, 3)
    assert causal_of(band, 8, 8, window=3) is True
    assert causal_of(band, 8, 8) is None  # without the module's window: a general mask
    assert causal_of(_band(8, 4), 8, 8, window=3) is None
    assert causal_of(torch.ones(8, 8, dtype=torch.bool).tril(), 8, 8, window=8) is True
