"""Tier 2: the gloo ring reduce-scatter and all-gather against a single-process reference and
against torch's own gloo collectives, with metering, ordering, aliasing and completion.

Every test runs on both transports of CPU collectives among ranks of one host: the rings
(``TESSERA_SHM=0``) and shared memory (``tessera.comm.shm``, the default there), which take
the same lanes, so the same ordering and completion rules hold for both.

Tolerances (``tol``): fp32 sums over at most 4 ranks agree to round-off (1e-6); bf16 partial
sums are rounded once per step of the ring, so one bf16 rounding (2**-8) per summand.

Hypothesis draws in the main thread; the worker-pool ranks each read their slice.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import (
    CommMeter,
    CommOp,
    Handle,
    all_gather,
    all_gather_async,
    all_reduce,
    batch_isend_irecv,
    gloo_ring,
    recv,
    reduce_scatter,
    reduce_scatter_async,
    send,
)
from tessera.comm.testing.fixtures import PoolFactory

TRANSPORTS = {"ring": {"TESSERA_SHM": "0"}, "shm": {"TESSERA_SHM": "1"}}

Meter = list[tuple[CommOp, int, int, int]]
_C10D_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards, as tessera does
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def tol(dtype: torch.dtype, n: int) -> dict[str, float]:
    """As in test_comm_collectives: fp32 round-off; bf16 one rounding per summand."""
    if dtype == torch.float32:
        return {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 2e-2, "atol": 1e-2 * n}


def _records(m: CommMeter) -> Meter:
    return [(r.op, r.volume_bytes, r.sent_bytes, r.recv_bytes) for r in m.records]


def _scribble(like: Tensor) -> list[Tensor]:
    """Allocate and fill buffers the size of a dropped input, so a use-after-free shows."""
    gc.collect()
    return [torch.full_like(like, float("nan")) for _ in range(4)]


def _both(
    rank: int, xs: list[Tensor], dim: int, op: str, use_async: bool, use_out: bool
) -> dict[str, object]:
    n = dist.get_world_size()
    x = xs[rank]
    shard = x.chunk(n, dim)[0].clone()  # what this rank all-gathers
    gathered_shape = (n * shard.shape[0], *shard.shape[1:])
    rs_out = torch.empty_like(x.chunk(n, dim)[0], memory_format=torch.contiguous_format) if use_out else None
    ag_out = torch.empty(gathered_shape, dtype=x.dtype) if use_out and dim % x.dim() == 0 else None
    with CommMeter() as m:
        if use_async:
            rs_handle = reduce_scatter_async(x.clone(), dim=dim, op=op, out=rs_out)  # type: ignore[arg-type]
            ag_handle = all_gather_async(shard.clone(), dim=dim, out=ag_out)  # inputs dropped at once
            junk = _scribble(x)
            rs, ag = rs_handle.wait(), ag_handle.wait()
            del junk
        else:
            rs = reduce_scatter(x, dim=dim, op=op, out=rs_out)  # type: ignore[arg-type]
            ag = all_gather(shard, dim=dim, out=ag_out)
    # torch's gloo collectives on the same inputs (the layout the c10d path hands them)
    c10d_rs = torch.empty_like(rs)
    dist.reduce_scatter_single(c10d_rs, torch.cat(x.chunk(n, dim), 0).contiguous(), op=_C10D_OPS[op])
    if op == "avg":
        c10d_rs /= n
    c10d_flat = torch.empty(gathered_shape, dtype=x.dtype)
    dist.all_gather_single(c10d_flat, shard.contiguous())
    c10d_ag = torch.cat(c10d_flat.chunk(n, 0), dim)
    return {
        "rs": rs,
        "ag": ag,
        "c10d_rs": c10d_rs,
        "c10d_ag": c10d_ag,
        "rs_is_out": rs_out is not None and rs is rs_out,
        "ag_is_out": ag_out is not None and ag is ag_out,
        "meter": _records(m),
    }


@settings(max_examples=60)
@given(
    n=st.sampled_from([2, 3, 4]),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    op=st.sampled_from(["sum", "avg", "max", "min"]),
    use_async=st.booleans(),
    use_out=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    transport=st.sampled_from(sorted(TRANSPORTS)),
)
def test_ring_matches_reference_and_torch(
    worker_pools: PoolFactory,
    n: int,
    shape: list[int],
    data: st.DataObject,
    dtype: torch.dtype,
    op: str,
    use_async: bool,
    use_out: bool,
    seed: int,
    transport: str,
) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    shape[dim] *= n
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]
    stacked = torch.stack([x.float() for x in xs])
    reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}[op]
    total = reduce(stacked, 0)
    gathered = torch.cat([x.chunk(n, dim)[0] for x in xs], dim)
    nbytes = xs[0].nbytes
    runs = worker_pools(n).run(_both, xs, dim, op, use_async, use_out, env=TRANSPORTS[transport])
    for rank, got in enumerate(runs):
        rs, ag = got["rs"], got["ag"]
        assert isinstance(rs, Tensor) and isinstance(ag, Tensor)
        assert rs.dtype == dtype and ag.dtype == dtype and rs.is_contiguous()
        torch.testing.assert_close(rs.float(), total.chunk(n, dim)[rank], **tol(dtype, n))
        if op in ("max", "min") or n == 2:  # the order of summation cannot differ
            assert torch.equal(rs, got["c10d_rs"])
        else:
            torch.testing.assert_close(rs, got["c10d_rs"], **tol(dtype, n))
        assert torch.equal(ag, gathered) and torch.equal(ag, got["c10d_ag"])
        assert got["rs_is_out"] == use_out
        assert got["ag_is_out"] == (use_out and dim % len(shape) == 0)
        ring = nbytes * (n - 1) // n
        assert got["meter"] == [
            (CommOp.REDUCE_SCATTER, nbytes, ring, ring),
            (CommOp.ALL_GATHER, nbytes, ring, ring),
        ]


def _ordered(rank: int, sizes: list[int]) -> list[Tensor]:
    """Several async rings in flight on one group, a blocking ring and an all-reduce between
    them, a user p2p message (tag 0) crossing them; waited on in reverse order."""
    n = dist.get_world_size()
    user = None
    if rank == 0:
        user = batch_isend_irecv([(torch.full((3,), 7.0), 1)], [])
    handles = []
    for i, size in enumerate(sizes):
        x = torch.arange(float(size * n)) + 1000 * rank + i
        handles.append(reduce_scatter_async(x) if i % 2 == 0 else all_gather_async(x[:size]))
        if i == 1:
            all_reduce(torch.ones(1))  # a torch collective between the rings
            handles.append(all_gather_async(torch.full((1,), float(rank))))
            sync = reduce_scatter(torch.ones(2 * n) * rank)  # a blocking ring behind the async ones
    if rank == 1:
        user = batch_isend_irecv([], [(torch.empty(3), 0)])
    results = [h.wait() for h in reversed(handles)][::-1]
    if user is not None:
        results.extend(user.wait())  # rank 1 receives; rank 0's send handle returns nothing
    return [*results, sync]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_async_rings_stay_ordered_per_group(worker_pools: PoolFactory, transport: str) -> None:
    n = 3
    sizes = [1 << 14, 5, 1 << 12, 3, 1 << 16, 1]
    per_rank = worker_pools(n).run(_ordered, sizes, env=TRANSPORTS[transport])
    for rank, got in enumerate(per_rank):
        expected: list[Tensor] = []
        for i, size in enumerate(sizes):
            xs = [torch.arange(float(size * n)) + 1000 * r + i for r in range(n)]
            if i % 2 == 0:
                expected.append(sum(xs[1:], xs[0]).chunk(n)[rank])
            else:
                expected.append(torch.cat([x[:size] for x in xs]))
            if i == 1:
                expected.append(torch.arange(float(n)))
        if rank == 1:
            expected.append(torch.full((3,), 7.0))
        expected.append(torch.full((2,), float(sum(range(n)))))
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):  # integer-valued: exact in any order
            assert torch.equal(a, b)


def _subgroups(rank: int) -> tuple[Tensor, Tensor, bool]:
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])  # every rank creates both
    group = evens if rank % 2 == 0 else odds
    x = torch.arange(4.0) * (rank + 1)
    handle = reduce_scatter_async(x, group, op="avg")
    gathered = all_gather(torch.tensor([float(rank)]), group)
    reduced = handle.wait()
    return reduced, gathered, gloo_ring.applies(x, group)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_rings_on_subgroups_use_group_ranks(worker_pools: PoolFactory, transport: str) -> None:
    for rank, (reduced, gathered, ring) in enumerate(
        worker_pools(4).run(_subgroups, env=TRANSPORTS[transport])
    ):
        members = [0, 2] if rank % 2 == 0 else [1, 3]
        mean = sum(torch.arange(4.0) * (r + 1) for r in members) / 2
        assert ring
        assert torch.equal(reduced, mean.chunk(2)[members.index(rank)])
        assert torch.equal(gathered, torch.tensor([float(r) for r in members]))


def _aliased(rank: int) -> tuple[Tensor, Tensor, bool, bool]:
    n = dist.get_world_size()
    x = torch.arange(float(2 * n)) + rank
    rs = reduce_scatter(x, out=x.chunk(n)[rank])  # the output is a chunk of the input
    full = torch.zeros(2 * n)
    shard = full.chunk(n)[rank]
    shard.fill_(float(rank))
    ag = all_gather_async(shard, out=full).wait()  # in place: the input is a chunk of the output
    return rs, ag, rs.data_ptr() == x.chunk(n)[rank].data_ptr(), ag.data_ptr() == full.data_ptr()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_outputs_may_alias_inputs(worker_pools: PoolFactory, transport: str) -> None:
    n = 3
    runs = worker_pools(n).run(_aliased, env=TRANSPORTS[transport])
    for rank, (rs, ag, rs_in_place, ag_in_place) in enumerate(runs):
        total = sum(torch.arange(float(2 * n)) + r for r in range(n))
        assert torch.equal(rs, total.chunk(n)[rank]) and rs_in_place
        assert torch.equal(ag, torch.arange(float(n)).repeat_interleave(2)) and ag_in_place


def _poll(handles: list[Handle[Tensor]]) -> bool:
    """Whether every handle reports completion within 30 s, without waiting on any of them."""
    deadline = time.monotonic() + 30.0  # a hang guard, not a timing assertion
    while not all(h.is_completed() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.001)
    return all(h.is_completed() for h in handles)


def _completion(rank: int) -> tuple[list[bool], bool, list[Tensor]]:
    """Rank 1 enters the rings only once rank 0 has looked at its handles: until then rank 0's
    rings cannot finish (they wait for rank 1's chunks), so a truthful handle says False. The
    group's first collective sets its transport up, collectively (shared memory: the ranks
    compare hosts), so it runs on both ranks before that."""
    all_reduce(torch.zeros(1))
    x = torch.arange(4.0) + 10 * rank
    if rank == 1:
        recv(torch.empty(1), 0)  # the go signal (user tag 0, not the ring's)
    handles = [reduce_scatter_async(x), all_gather_async(x)]
    early = [h.is_completed() for h in handles]
    if rank == 0:
        send(torch.ones(1), 1)
    return early, _poll(handles), [h.wait() for h in handles]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_ring_handles_report_completion_truthfully(worker_pools: PoolFactory, transport: str) -> None:
    (early0, done0, got0), (_, done1, got1) = worker_pools(2).run(_completion, env=TRANSPORTS[transport])
    assert early0 == [False, False]  # rank 1 had not contributed yet
    assert done0 and done1  # completion shows without wait()
    xs = [torch.arange(4.0), torch.arange(4.0) + 10]
    for rank, (rs, ag) in enumerate((got0, got1)):
        assert torch.equal(rs, (xs[0] + xs[1]).chunk(2)[rank]) and torch.equal(ag, torch.cat(xs))


class _NeverReports:
    """A Work like torch's gloo reduce-scatter's: it finishes on wait() but never says so."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return False


def test_a_handle_reports_completion_once_waited_even_if_its_work_never_does() -> None:
    work = _NeverReports()
    handle = Handle([work], lambda: torch.ones(1))
    assert not handle.is_completed()
    assert torch.equal(handle.wait(), torch.ones(1)) and work.waited
    assert handle.is_completed()  # as documented: True once wait() has returned


def test_lane_runs_in_order_delivers_errors_and_retires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gloo_ring, "LANE_IDLE_S", 0.05)
    lane = gloo_ring._Lane()
    seen: list[int] = []

    def step(i: int) -> int:
        if i == 3:
            raise ValueError("ring 3 failed")
        seen.append(i)
        return i

    futures: list[Future[int]] = [lane.submit(lambda i=i: step(i)) for i in range(8)]  # type: ignore[misc]
    lane.wait_idle()
    assert seen == [0, 1, 2, 4, 5, 6, 7]
    assert [f.result() for i, f in enumerate(futures) if i != 3] == seen
    with pytest.raises(ValueError, match="ring 3 failed"):
        futures[3].result()
    deadline = time.monotonic() + 30.0  # the worker exits once idle (a hang guard)
    while any(t.name == "tessera-gloo-ring" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "tessera-gloo-ring" for t in threading.enumerate())
    assert lane.submit(lambda: 9).result() == 9  # and a new one starts on demand


def test_lane_lets_a_finished_ring_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ring's closure holds (an all-gather's copy of its shard) is freed once the ring
    has run, while the lane's thread waits for more work (not when the next ring arrives)."""
    monkeypatch.setattr(gloo_ring, "LANE_IDLE_S", 60.0)  # the worker stays, idle, through the test

    class Buffer:
        pass

    lane = gloo_ring._Lane()
    buffer = Buffer()
    held = weakref.ref(buffer)
    lane.submit(lambda b=buffer: None).result()  # type: ignore[misc]
    del buffer
    deadline = time.monotonic() + 10.0  # a hang guard, not a timing: the thread lets go at once
    while held() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held() is None
