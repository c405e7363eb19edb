"""Tier 1: every collective against a single-process reference, and the bytes the meter reports.

Hypothesis draws shapes, dtypes and world sizes in the main thread; the ranks (threads)
each read their slice of the drawn inputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import (
    CommMeter,
    CommOp,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
)
from tessera.comm.testing import run_threaded

WORLDS = st.sampled_from([1, 2, 3, 4, 8])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def tol(dtype: torch.dtype, n: int = 1) -> dict[str, float]:
    """fp32 round-off; for bf16 one rounding (2**-8 relative) per summand of a reduction."""
    if dtype == torch.float32:
        return {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 2e-2, "atol": 1e-2 * n}


def inputs(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]


@st.composite
def case(draw: st.DrawFn, divisible_dim: bool = False) -> tuple[int, tuple[int, ...], int, torch.dtype, int]:
    n = draw(WORLDS)
    shape = list(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    if divisible_dim:
        shape[dim] *= n
    return n, tuple(shape), dim, draw(DTYPES), draw(st.integers(0, 2**31 - 1))


def _ring(nbytes: int, n: int) -> int:
    return nbytes * (n - 1) // n


def _all_reduce(rank: int, xs: list[Tensor], op: str) -> tuple[Tensor, list[tuple[int, int, int]]]:
    with CommMeter() as m:
        out = all_reduce(xs[rank], op=op)  # type: ignore[arg-type]
    return out, [(r.volume_bytes, r.sent_bytes, r.recv_bytes) for r in m.records]


@settings(max_examples=40)
@given(case(), st.sampled_from(["sum", "avg", "max", "min"]))
def test_all_reduce(c: tuple[int, tuple[int, ...], int, torch.dtype, int], op: str) -> None:
    n, shape, _, dtype, seed = c
    xs = inputs(n, shape, dtype, seed)
    stacked = torch.stack([x.float() for x in xs])
    ref = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    for rank, (out, recs) in enumerate(run_threaded(n, _all_reduce, xs, op)):
        assert out.dtype == dtype and out.shape == xs[rank].shape
        torch.testing.assert_close(out.float(), ref, **tol(dtype, n))
        nbytes = xs[rank].nbytes
        if n == 1:
            assert recs == []
        else:
            padded = -(-xs[rank].numel() // n) * n * xs[rank].element_size()
            assert recs == [(2 * nbytes, 2 * _ring(padded, n), 2 * _ring(padded, n))]


def _gather(rank: int, xs: list[Tensor], dim: int) -> tuple[Tensor, int, int]:
    with CommMeter() as m:
        out = all_gather(xs[rank], dim=dim)
    return out, m.volume_bytes, m.sent_bytes


@settings(max_examples=40)
@given(case())
def test_all_gather(c: tuple[int, tuple[int, ...], int, torch.dtype, int]) -> None:
    n, shape, dim, dtype, seed = c
    xs = inputs(n, shape, dtype, seed)
    ref = torch.cat(xs, dim=dim)
    for out, volume, sent in run_threaded(n, _gather, xs, dim):
        assert torch.equal(out, ref)
        assert volume == (ref.nbytes if n > 1 else 0)
        assert sent == (ref.nbytes - xs[0].nbytes if n > 1 else 0)


def _reduce_scatter(rank: int, xs: list[Tensor], dim: int) -> tuple[Tensor, int, int]:
    with CommMeter() as m:
        out = reduce_scatter(xs[rank], dim=dim)
    return out, m.volume_bytes, m.recv_bytes


@settings(max_examples=40)
@given(case(divisible_dim=True))
def test_reduce_scatter(c: tuple[int, tuple[int, ...], int, torch.dtype, int]) -> None:
    n, shape, dim, dtype, seed = c
    xs = inputs(n, shape, dtype, seed)
    total = torch.stack([x.float() for x in xs]).sum(0)
    for rank, (out, volume, recv) in enumerate(run_threaded(n, _reduce_scatter, xs, dim)):
        torch.testing.assert_close(out.float(), total.chunk(n, dim)[rank], **tol(dtype, n))
        assert volume == (xs[0].nbytes if n > 1 else 0)
        assert recv == (xs[0].nbytes - out.nbytes if n > 1 else 0)


def _all_to_all(rank: int, xs: list[Tensor], sdim: int, gdim: int) -> tuple[Tensor, int, int]:
    with CommMeter() as m:
        out = all_to_all(xs[rank], scatter_dim=sdim, gather_dim=gdim)
    return out, m.sent_bytes, m.volume_bytes


@settings(max_examples=40)
@given(case(divisible_dim=True), st.data())
def test_all_to_all(c: tuple[int, tuple[int, ...], int, torch.dtype, int], data: st.DataObject) -> None:
    n, shape, sdim, dtype, seed = c
    gdim = data.draw(st.integers(0, len(shape) - 1))
    xs = inputs(n, shape, dtype, seed)
    for rank, (out, sent, volume) in enumerate(run_threaded(n, _all_to_all, xs, sdim, gdim)):
        ref = torch.cat([xs[src].chunk(n, sdim)[rank] for src in range(n)], dim=gdim)
        assert torch.equal(out, ref)
        assert sent == (xs[0].nbytes - xs[0].nbytes // n if n > 1 else 0)
        assert volume == (xs[0].nbytes if n > 1 else 0)


def _broadcast(rank: int, xs: list[Tensor], src: int) -> tuple[Tensor, int, int]:
    with CommMeter() as m:
        out = broadcast(xs[rank], src)
    return out, m.sent_bytes, m.recv_bytes


@settings(max_examples=30)
@given(case(), st.data())
def test_broadcast(c: tuple[int, tuple[int, ...], int, torch.dtype, int], data: st.DataObject) -> None:
    n, shape, _, dtype, seed = c
    src = data.draw(st.integers(0, n - 1))
    xs = inputs(n, shape, dtype, seed)
    for rank, (out, sent, recv) in enumerate(run_threaded(n, _broadcast, xs, src)):
        assert torch.equal(out, xs[src])
        nbytes = xs[0].nbytes if n > 1 else 0
        assert (sent, recv) == ((nbytes, 0) if rank == src else (0, nbytes))


def _inputs_untouched(rank: int, x: Tensor) -> bool:
    before = x.clone()
    all_reduce(x)
    all_gather(x)
    reduce_scatter(x)
    return torch.equal(before, x)


def test_collectives_never_mutate_their_input() -> None:
    assert all(run_threaded(2, _inputs_untouched, torch.ones(4, 2)))


def _bad_reduce_scatter(rank: int) -> None:
    reduce_scatter(torch.ones(3, 2))


def test_indivisible_reduce_scatter_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"size 3 of dim 0 .* not divisible by the group size 2"):
        run_threaded(2, _bad_reduce_scatter)


def _meter_nesting(rank: int) -> tuple[int, int, dict[CommOp, int]]:
    with CommMeter() as outer:
        all_reduce(torch.ones(4))
        with CommMeter() as inner:
            all_gather(torch.ones(4))
    return outer.count(), inner.count(), outer.by_op()


def test_meters_nest_and_are_per_rank() -> None:
    for outer, inner, by_op in run_threaded(2, _meter_nesting):
        assert (outer, inner) == (2, 1)
        assert by_op == {CommOp.ALL_REDUCE: 32, CommOp.ALL_GATHER: 32}


def _into_buffers(rank: int, n: int) -> tuple[bool, bool, bool, Tensor, Tensor]:
    x = torch.full((2 * n, 3), float(rank + 1))
    gathered = torch.empty(2 * n * n, 3)
    shard = torch.empty(2, 3)
    reduced = all_reduce(x, inplace=True)
    g = all_gather(x, out=gathered)
    r = reduce_scatter(x, out=shard)
    return reduced is x, g is gathered, r is shard, g, r


@pytest.mark.parametrize("n", [1, 2, 3])
def test_inplace_and_out_variants_write_where_told(n: int) -> None:
    total = n * (n + 1) / 2
    for same_x, same_g, same_r, g, r in run_threaded(n, _into_buffers, n):
        assert same_x and same_g and same_r
        assert torch.equal(g, torch.full((2 * n * n, 3), total))
        assert torch.equal(r, torch.full((2, 3), total * n))


def _bad_out(rank: int) -> None:
    all_gather(torch.ones(2, 3), out=torch.empty(4, 2))


def test_wrong_out_buffer_names_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"shape \(4, 3\), got torch.float32 \(4, 2\)"):
        run_threaded(2, _bad_out)
