"""Tier 2: p2p and meshes on the persistent gloo worker pool, and how the pool handles failure."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import (
    CommMeter,
    Mesh,
    Topology,
    all_reduce,
    batch_isend_irecv,
    recv,
    ring_shift,
    ring_shift_async,
    send,
)
from tessera.comm.testing import PoolTimeout, RankFailure, WorkerPool
from tessera.comm.testing.fixtures import PoolFactory


def _ring(rank: int, xs: list[Tensor], shift: int, use_async: bool) -> tuple[Tensor, int, int]:
    with CommMeter() as m:
        if use_async:
            out = ring_shift_async(xs[rank], shift=shift).wait()
        else:
            out = ring_shift(xs[rank], shift=shift)
    return out, m.sent_bytes, m.recv_bytes


@settings(max_examples=15)
@given(
    n=st.sampled_from([2, 3, 4]),
    shift=st.integers(-5, 5),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    use_async=st.booleans(),
)
def test_ring_shift(
    worker_pools: PoolFactory, n: int, shift: int, shape: list[int], dtype: torch.dtype, use_async: bool
) -> None:
    xs = [torch.randn(shape).to(dtype) for _ in range(n)]
    for rank, (out, sent, received) in enumerate(worker_pools(n).run(_ring, xs, shift, use_async)):
        assert torch.equal(out, xs[(rank - shift) % n])
        moved = 0 if shift % n == 0 else xs[0].nbytes
        assert (sent, received) == (moved, moved)


def _round_trip(rank: int, x: Tensor) -> Tensor | None:
    if rank == 0:
        send(x, 1)
        return recv(x, 1)
    if rank == 1:
        y = recv(x, 0)
        send(y * 2, 0)
    return None


def test_p2p_round_trip(worker_pools: PoolFactory) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    out = worker_pools(4).run(_round_trip, x)
    assert torch.equal(out[0], x * 2)


def _exchange(rank: int, n: int) -> list[Tensor]:
    # every rank sends its rank to every other rank in one batch
    sends = [(torch.full((2,), float(rank)), peer) for peer in range(n) if peer != rank]
    recvs = [(torch.empty(2), peer) for peer in range(n) if peer != rank]
    return batch_isend_irecv(sends, recvs).wait()


def test_batch_isend_irecv_all_pairs(worker_pools: PoolFactory) -> None:
    for rank, got in enumerate(worker_pools(4).run(_exchange, 4)):
        peers = [p for p in range(4) if p != rank]
        assert [t[0].item() for t in got] == [float(p) for p in peers]


def _mesh_groups(rank: int, kwargs: dict[str, object]) -> dict[str, object]:
    topo = Topology(**kwargs)  # type: ignore[arg-type]
    with Mesh(topo, combined=[("dp", "tp")]) as mesh:
        out: dict[str, object] = {}
        for axis in [*topo.axes, ("dp", "tp")]:
            key = axis if isinstance(axis, str) else "+".join(axis)
            group = mesh.group(axis)
            # sum of global ranks over the group proves the group holds the right ranks
            total = all_reduce(torch.tensor([float(rank)]), group)
            out[key] = (dist.get_world_size(group), total.item(), mesh.ranks(axis))
        return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dp": 2, "tp": 2},
        {"pp": 2, "tp": 2},
        {"tp": 4, "tp_mode": "2d"},
        {"dp": 2, "cp": 2},
        {"dp": 4, "ep": 2},
    ],
)
def test_mesh_builds_every_axis_on_gloo(worker_pools: PoolFactory, kwargs: dict[str, object]) -> None:
    for per_axis in worker_pools(4).run(_mesh_groups, kwargs):
        for key, (size, total, ranks) in per_axis.items():  # type: ignore[attr-defined]
            assert size == len(ranks), key
            assert total == float(sum(ranks)), key


def _never_sent(rank: int) -> None:
    if rank == 1:
        recv(torch.empty(3), 0)  # rank 0 never sends


def _pid(rank: int) -> int:
    return os.getpid()


def test_a_missing_send_fails_with_the_stuck_stack(worker_pools: PoolFactory) -> None:
    """The pool's own timeout (3 s here) ends the call, not the process group's (300 s, which
    would hang the test); the stuck workers are replaced, and a healthy pool is reused."""
    pool = worker_pools(2)
    before = pool.run(_pid)
    assert pool.run(_pid) == before  # a call that succeeds keeps the workers
    starts = pool.starts
    with pytest.raises(PoolTimeout) as info:
        pool.run(_never_sent, timeout=3.0)
    message = str(info.value)
    assert "ranks [1] of 2 did not finish within 3.0 s" in message
    assert "_never_sent" in message  # rank 1's Python stack is in the error
    after = pool.run(_pid)
    assert set(after).isdisjoint(before)  # every worker was replaced, the stuck one included
    assert pool.starts == starts + 1
    assert torch.equal(pool.run(_round_trip, torch.ones(2))[0], torch.ones(2) * 2)
    assert pool.run(_pid) == after  # and the new pool is reused


def _raise_on_rank(rank: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"bad value on rank {rank}")
    all_reduce(torch.ones(1))  # the others wait in a collective the bad rank never joins
    return rank


def test_an_exception_on_one_rank_reaches_the_caller(worker_pools: PoolFactory) -> None:
    pool = worker_pools(2)
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        pool.run(_raise_on_rank, 1, timeout=20.0)
    assert any("raised on rank 1 of 2" in note for note in info.value.__notes__)
    assert pool.run(_raise_on_rank, -1) == [0, 1]


class _Unpicklable(Exception):
    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("cannot pickle")


def _raise_unpicklable(rank: int) -> None:
    raise _Unpicklable("odd")


def test_unpicklable_exceptions_arrive_as_text() -> None:
    with WorkerPool(1) as pool, pytest.raises(RankFailure, match="_Unpicklable: odd"):
        pool.run(_raise_unpicklable)


def _tagged(rank: int) -> list[float]:
    if rank == 0:
        # sent in the order tag 1, tag 2; received below in the order tag 2, tag 1
        batch_isend_irecv([(torch.ones(1), 1)], [], tag=1).wait()
        batch_isend_irecv([(torch.full((1,), 2.0), 1)], [], tag=2).wait()
        return []
    second = batch_isend_irecv([], [(torch.empty(1), 0)], tag=2)
    first = batch_isend_irecv([], [(torch.empty(1), 0)], tag=1)
    return [first.wait()[0].item(), second.wait()[0].item()]


def test_p2p_tags_match_sends_to_receives(worker_pools: PoolFactory) -> None:
    assert worker_pools(2).run(_tagged)[1] == [1.0, 2.0]


def _live_groups(rank: int) -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _mesh_then_close(rank: int, kwargs: dict[str, object]) -> tuple[int, int, int]:
    before = _live_groups(rank)
    mesh = Mesh(Topology(**kwargs), combined=[("dp", "tp")])  # type: ignore[arg-type]
    built = _live_groups(rank)
    mesh.close()
    mesh.close()  # twice is harmless
    return before, built, _live_groups(rank)


@pytest.mark.parametrize("kwargs", [{"dp": 2, "tp": 2}, {"pp": 2, "cp": 2}, {"tp": 4, "tp_mode": "2d"}])
def test_closing_a_mesh_releases_every_group_it_made(
    worker_pools: PoolFactory, kwargs: dict[str, object]
) -> None:
    for rank, (before, built, after) in enumerate(worker_pools(4).run(_mesh_then_close, kwargs)):
        assert built > before, f"rank {rank}: the mesh made no group ({before} -> {built})"
        assert after == before, f"rank {rank}: {after - before} of the mesh's groups outlived close()"


def _leave_groups_behind(rank: int) -> int:
    for _ in range(3):
        dist.new_group([0, 1])
    return _live_groups(rank)


def test_the_pool_releases_the_groups_a_call_left_behind(worker_pools: PoolFactory) -> None:
    pool = worker_pools(2)
    baseline = pool.run(_live_groups)
    held = pool.run(_leave_groups_behind)
    assert all(h == b + 3 for h, b in zip(held, baseline, strict=True)), (baseline, held)
    assert pool.run(_live_groups) == baseline  # gone before the next call
