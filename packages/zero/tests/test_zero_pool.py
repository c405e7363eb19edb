"""Tier 0: ``BufferPool`` moves memory between storages without touching what views see.

Values are exact (the pool copies nothing: it swaps which storage owns a block of memory),
so the checks are equalities and storage identities, no tolerances.
"""

from __future__ import annotations

import pytest
import torch

from tessera.zero.pool import BufferPool


def test_a_released_storage_refills_another_of_the_same_size_in_place() -> None:
    """The memory of a released buffer backs the next buffer of that size: its storage object,
    and so every view of it (parameters, what autograd saved), stays the same."""
    pool = BufferPool()
    a, b = torch.arange(6.0), torch.zeros(6)
    a_view, b_view = a[2:4], b[1:3]
    memory = a.untyped_storage().data_ptr()
    pool.release(a.untyped_storage())
    assert a.untyped_storage().nbytes() == 0 and a_view.untyped_storage().nbytes() == 0
    assert len(pool.held()) == 1 and pool.held()[0].untyped_storage().nbytes() == 24
    pool.release(b.untyped_storage())  # one spare of a size at most: this one goes back
    assert b.untyped_storage().nbytes() == 0 and len(pool.held()) == 1
    pool.fill(b.untyped_storage(), 24)
    assert b.untyped_storage().data_ptr() == memory and pool.reused == 1
    b.copy_(torch.full((6,), 7.0))
    assert torch.equal(b_view, torch.full((2,), 7.0))
    pool.fill(a.untyped_storage(), 24)  # nothing spare: new memory
    assert a.untyped_storage().nbytes() == 24 and pool.reused == 1 and pool.held() == []


def test_gradient_buffers_come_back_zeroed_and_only_while_open() -> None:
    pool = BufferPool()
    g = pool.zeros(5, torch.float32, torch.device("cpu"))
    g.fill_(3.0)
    pool.give(g)
    again = pool.zeros(5, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == g.data_ptr() and torch.equal(again, torch.zeros(5))
    assert pool.zeros(5, torch.float64, torch.device("cpu")).data_ptr() != g.data_ptr()
    pool.give(again)
    pool.close()
    assert pool.held() == []
    pool.give(torch.ones(5))
    s = torch.ones(4)
    pool.release(s.untyped_storage())
    assert pool.held() == [] and s.untyped_storage().nbytes() == 0  # closed: back to the system
    pool.open()
    pool.give(torch.ones(5))
    assert len(pool.held()) == 1


def test_a_negative_spare_count_is_refused() -> None:
    with pytest.raises(ValueError, match="max_per_size must be >= 0, got -1"):
        BufferPool(max_per_size=-1)


def test_a_request_of_another_size_releases_the_spares_waiting_for_theirs() -> None:
    """A spare serves only the next request of its kind: one of another size drops it."""
    pool = BufferPool()
    big, small = torch.zeros(8).untyped_storage(), torch.empty(0).untyped_storage()
    pool.release(big)  # a spare of 32 bytes
    pool.fill(small, 8)  # another size: new memory, and the spare is dropped
    assert small.nbytes() == 8 and pool.held() == [] and pool.reused == 0
    pool.give(torch.zeros(8))
    pool.zeros(2, torch.float32, torch.device("cpu"))
    assert pool.held() == []
