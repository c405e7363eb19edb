"""Tiers 1 and 2: the uneven all-to-all (`all_to_all_rows`) against a single-process
reference, on threads and on gloo processes, with the bytes the meter reports.

Hypothesis draws every pair's row count (zero included) in the main thread; each rank reads
its row of the count matrix. The values only move, so the comparison is exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import CommMeter, all_to_all_rows
from tessera.comm.testing import run_threaded
from tessera.comm.testing.fixtures import PoolFactory


def _pieces(counts: list[list[int]], width: int, dtype: torch.dtype) -> list[Tensor]:
    """Rank s's input: its rows for rank 0, then rank 1, ...; row values name (s, j, i)."""
    xs = []
    for s, row in enumerate(counts):
        parts = [
            torch.full((c, width), 1000.0 * s + 10.0 * j, dtype=dtype) + torch.arange(c)[:, None].to(dtype)
            for j, c in enumerate(row)
        ]
        xs.append(torch.cat(parts) if parts else torch.empty(0, width, dtype=dtype))
    return xs


def _expected(counts: list[list[int]], xs: list[Tensor], rank: int) -> Tensor:
    pieces = [xs[s].split(counts[s])[rank] for s in range(len(counts))]
    return torch.cat(pieces)


def _exchange(rank: int, counts: list[list[int]], xs: list[Tensor]) -> tuple[Tensor, int, int]:
    send = counts[rank]
    recv = [counts[s][rank] for s in range(len(counts))]
    with CommMeter() as m:
        out = all_to_all_rows(xs[rank], send, recv)
    return out, m.sent_bytes, m.recv_bytes


def _counts(n: int) -> st.SearchStrategy[list[list[int]]]:
    return st.lists(st.lists(st.integers(0, 5), min_size=n, max_size=n), min_size=n, max_size=n)


@settings(max_examples=40)
@given(st.data(), st.sampled_from([1, 2, 3, 4]), st.sampled_from([torch.float32, torch.int64]))
def test_all_to_all_rows_threaded(data: st.DataObject, n: int, dtype: torch.dtype) -> None:
    counts = data.draw(_counts(n))
    xs = _pieces(counts, 3, dtype)
    row = 3 * xs[0].element_size()
    for rank, (out, sent, recv) in enumerate(run_threaded(n, _exchange, counts, xs)):
        assert torch.equal(out, _expected(counts, xs, rank))
        kept = counts[rank][rank] if n > 1 else sum(counts[rank])
        assert sent == (sum(counts[rank]) - kept) * row
        assert recv == (sum(counts[s][rank] for s in range(n)) - kept) * row


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_all_to_all_rows_gloo(worker_pools: PoolFactory, transport: str) -> None:
    counts = [[2, 0, 3], [0, 0, 1], [4, 2, 0]]  # a rank that sends nothing to itself, an empty pair
    xs = _pieces(counts, 2, torch.float32)
    env = {"TESSERA_SHM": "1" if transport == "shm" else "0"}
    for rank, (out, _, _) in enumerate(worker_pools(3).run(_exchange, counts, xs, env=env)):
        assert torch.equal(out, _expected(counts, xs, rank))


def _refuse(rank: int, send: list[int], recv: list[int], rows: int) -> None:
    all_to_all_rows(torch.zeros(rows, 2), send, recv)


@pytest.mark.parametrize(
    ("send", "recv", "rows", "match"),
    [
        ([1], [1, 1], 2, r"send_rows must be 2 counts >= 0 \(one per rank\), got \[1\]"),
        ([1, -1], [1, 1], 0, r"send_rows must be 2 counts >= 0 \(one per rank\), got \[1, -1\]"),
        ([1, 2], [1, 1], 2, r"send_rows \[1, 2\] must sum to the rows of x \(shape \(2, 2\)\)"),
    ],
)
def test_all_to_all_rows_refuses_bad_counts(send: list[int], recv: list[int], rows: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_threaded(2, _refuse, send, recv, rows)
