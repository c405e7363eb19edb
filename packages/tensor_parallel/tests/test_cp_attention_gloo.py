"""Tier 2: ring and Ulysses attention on gloo processes against serial attention.

Every rank gets the full q, k, v and output gradient, keeps its slice of the sequence
(``split_batch``), runs context-parallel attention forward and backward and returns its slice
of out, dq, dk, dv; the test reassembles them (``unsplit_sequence``) and compares with
``F.scaled_dot_product_attention`` on the full sequence (K/V heads repeated for GQA).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import CommMeter, CommOp
from tessera.comm.testing.fixtures import PoolFactory
from tessera.tensor_parallel.context import (
    ContextParallelAttention,
    Layout,
    Mode,
    split_batch,
    unsplit_sequence,
)

# fp32: the parallel result sums the softmax over blocks merged by the log-sum-exp rule (and
# GQA key gradients over heads in another order), the serial one in one pass; with unit-scale
# inputs and at most 32 keys the outputs and gradients are O(1) and differ by a few ulp
# (measured up to 2e-6 on values up to ~4); a wrong mask, block or merge is off by O(0.1).
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _attend(
    rank: int, mode: str, layout: str, causal: bool, tensors: list[Tensor], meter: bool
) -> dict[str, Any]:
    q, k, v, dout = split_batch(*tensors, group=None, layout=layout, dim=2)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    core = ContextParallelAttention(None, mode=mode, layout=layout, causal=causal)
    with CommMeter() as forward:
        out = core(q, k, v)
    with CommMeter() as backward:
        out.backward(dout)
    result: dict[str, Any] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if meter:
        result["bytes"] = {
            "local_kv": k.nbytes + v.nbytes,
            "activations": q.nbytes + k.nbytes + v.nbytes + out.nbytes,
            "forward": (forward.sent_bytes, forward.by_op(), forward.count()),
            "backward": (backward.sent_bytes, backward.by_op(), backward.count()),
        }
    return result


def _serial(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool) -> list[Tensor]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=causal
    )
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


def _inputs(seed: int, batch: int, heads: int, kv_heads: int, seq: int, dim: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, heads, seq, dim),
        (batch, kv_heads, seq, dim),
        (batch, kv_heads, seq, dim),
        (batch, heads, seq, dim),
    ]
    return [torch.randn(s, generator=gen) for s in shapes]


@st.composite
def shapes(draw: st.DrawFn, cp: int, mode: Mode, layout: Layout) -> tuple[int, int, int, int, int]:
    """(batch, heads, kv_heads, seq, head_dim) that the mode and layout accept."""
    kv_heads = draw(st.sampled_from([1, 2, 4] if mode is Mode.RING else [cp]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    chunks = 2 * cp if layout is Layout.ZIGZAG else cp
    seq = chunks * draw(st.integers(1, 32 // chunks))
    return draw(st.integers(1, 2)), heads, kv_heads, seq, draw(st.sampled_from([3, 8]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("cp", [2, 4])
@settings(max_examples=3)
@given(data=st.data())
def test_attention_equals_serial(
    worker_pools: PoolFactory, cp: int, mode: Mode, layout: Layout, causal: bool, data: st.DataObject
) -> None:
    """out, dq, dk, dv of context-parallel attention over shapes (GQA, head dims); TOL above."""
    shape = data.draw(shapes(cp, mode, layout))
    tensors = _inputs(data.draw(st.integers(0, 99)), *shape)
    results = worker_pools(cp).run(_attend, mode.value, layout.value, causal, tensors, False)
    want = _serial(*tensors, causal=causal)
    for key, serial in zip(("out", "dq", "dk", "dv"), want, strict=True):
        got = unsplit_sequence([r[key] for r in results], layout, dim=2)
        torch.testing.assert_close(got, serial, **TOL)


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_moved_per_attention_layer(worker_pools: PoolFactory, cp: int) -> None:
    """Ring: each rank sends cp-1 local K/V blocks forward ((cp-1)/cp of the full K and V), and
    twice that backward (K/V again plus dK/dV, fp32 like the inputs). Ulysses: 4 all-to-alls
    of the activations forward (q, k, v, out: volume their local bytes), 4 backward. Exact."""
    tensors = _inputs(0, 2, 4, 4, 8 * cp, 8)
    for mode in Mode:
        for rank_result in worker_pools(cp).run(_attend, mode.value, "zigzag", True, tensors, True):
            b = rank_result["bytes"]
            (fwd_sent, fwd_ops, fwd_count), (bwd_sent, bwd_ops, bwd_count) = b["forward"], b["backward"]
            if mode is Mode.RING:
                assert fwd_sent == (cp - 1) * b["local_kv"]
                assert bwd_sent == 2 * (cp - 1) * b["local_kv"]
                assert set(fwd_ops) == set(bwd_ops) == {CommOp.SEND, CommOp.RECV}
            else:
                assert fwd_ops == bwd_ops == {CommOp.ALL_TO_ALL: b["activations"]}
                assert fwd_count == bwd_count == 4
                assert fwd_sent == bwd_sent == b["activations"] * (cp - 1) // cp


def _ulysses_error(rank: int) -> str:
    q = torch.zeros(1, 6, 4, 8)
    kv = torch.zeros(1, 2, 4, 8)
    with CommMeter() as meter:
        try:
            ContextParallelAttention(None, mode="ulysses")(q, kv, kv)
        except ValueError as e:
            return f"{e} after {meter.count()} calls"
    return "no error"


def test_ulysses_needs_divisible_heads(worker_pools: PoolFactory) -> None:
    for message in worker_pools(4).run(_ulysses_error):
        assert message == "Ulysses attention needs heads=6 and kv heads=2 divisible by cp=4 after 0 calls"
