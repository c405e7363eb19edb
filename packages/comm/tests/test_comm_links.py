"""Tier 2: CPU point-to-point on the gloo worker pool, over both of its transports: links
(``tessera.comm.links``, private gloo groups; ``TESSERA_SHM=0``) and shared memory
(``tessera.comm.shm_p2p``, once ``share_memory`` has run on the group).

What the pipeline runtime and the rings rely on: handles report completion without being
waited on; messages of one (pair, tag) arrive in post order, whatever their dtype and size
(shared memory: pieces of 256 KiB, FIFOs of 1 MiB, so larger messages go in several turns,
both ways at once); tags and directions are independent; ranks may start talking in any
order (nothing blocks on a peer that is busy elsewhere); a receive whose buffer does not
match the message fails naming both sizes.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import batch_isend_irecv, links, ring_shift, share_memory
from tessera.comm.testing.fixtures import PoolFactory

DEADLINE_S = 60.0
TRANSPORTS = {"links": {"TESSERA_SHM": "0"}, "shm": {"TESSERA_SHM": "1"}}
both = pytest.mark.parametrize("transport", sorted(TRANSPORTS))


def _transport(expected: str) -> None:
    """Set the world group's shared memory up (collective) and check the transport."""
    shared = share_memory(None)
    assert shared == (expected == "shm"), f"share_memory said {shared} under {expected}"


def _polled_until_complete(rank: int, x: Tensor, transport: str) -> tuple[Tensor | None, bool]:
    _transport(transport)
    if rank == 0:
        batch_isend_irecv([(x, 1)], []).wait()
        return None, True
    handle = batch_isend_irecv([], [(torch.empty_like(x), 0)])
    start = time.monotonic()
    while not handle.is_completed():  # never waited on: completion must be reported as it happens
        if time.monotonic() - start > DEADLINE_S:
            return None, False
        time.sleep(0.001)
    return handle.wait()[0], True


@both
def test_a_receive_reports_completion_without_being_waited_on(
    worker_pools: PoolFactory, transport: str
) -> None:
    x = torch.arange(10.0)
    _, (got, completed) = worker_pools(2).run(_polled_until_complete, x, transport, env=TRANSPORTS[transport])
    assert completed, f"a link receive did not report completion within {DEADLINE_S} s"
    assert got is not None and torch.equal(got, x)


def _messages(rank: int, xs: list[Tensor], tags: list[int], transport: str) -> list[Tensor]:
    """Rank 0 posts every message alone (not waiting), then waits; rank 1 receives them in
    order, and sends each back doubled on the reverse link."""
    _transport(transport)
    if rank == 0:
        sent = [batch_isend_irecv([(x, 1)], [], tag=t) for x, t in zip(xs, tags, strict=True)]
        back = [
            batch_isend_irecv([], [(torch.empty_like(x), 1)], tag=t) for x, t in zip(xs, tags, strict=True)
        ]
        for h in sent:
            h.wait()
        return [h.wait()[0] for h in back]
    got = [
        batch_isend_irecv([], [(torch.empty_like(x), 0)], tag=t).wait()[0]
        for x, t in zip(xs, tags, strict=True)
    ]
    for y, t in zip(got, tags, strict=True):
        batch_isend_irecv([(y + y, 0)], [], tag=t).wait()
    return got


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


@settings(max_examples=16, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 1200), min_size=1, max_size=2), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6),
    tags=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    transport=st.sampled_from(sorted(TRANSPORTS)),
)
def test_messages_arrive_in_post_order_per_tag_any_dtype_and_size(
    worker_pools: PoolFactory,
    shapes: list[list[int]],
    dtypes: list[torch.dtype],
    tags: list[int],
    transport: str,
) -> None:
    """Exact: the bytes travel unchanged. Empty tensors included (no message on the wire);
    up to 1.44 M elements of 8 bytes: 11 MiB, many turns of a 1 MiB FIFO."""
    xs = [(torch.randn(shape) * 100).to(dtypes[i]) for i, shape in enumerate(shapes)]
    back, got = worker_pools(2).run(_messages, xs, tags[: len(xs)], transport, env=TRANSPORTS[transport])
    for i, x in enumerate(xs):
        assert torch.equal(got[i], x), f"message {i} ({x.dtype}, {tuple(x.shape)}) changed in transit"
        assert torch.equal(back[i], x + x), f"reply {i} ({x.dtype}, {tuple(x.shape)}) changed in transit"


def _cycle(rank: int, n: int, transport: str) -> Tensor:
    """Each rank first sends to the next rank alone and waits, only then receives from the
    previous one: completes only if no rank blocks connecting to a peer busy elsewhere
    (torch's p2p allows this order, and so must links)."""
    _transport(transport)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    out = batch_isend_irecv([(torch.full((3,), float(rank)), nxt)], [])
    got = batch_isend_irecv([], [(torch.empty(3), prv)]).wait()[0]
    out.wait()
    return got


@both
def test_ranks_may_start_talking_in_a_cycle(worker_pools: PoolFactory, transport: str) -> None:
    n = 3
    for rank, got in enumerate(worker_pools(n).run(_cycle, n, transport, env=TRANSPORTS[transport])):
        assert torch.equal(got, torch.full((3,), float((rank - 1) % n)))


def _applies(rank: int) -> tuple[bool, bool]:
    return links.applies([torch.ones(2)], None), links.applies([], None)


def test_links_carry_cpu_tensors_on_gloo_groups(worker_pools: PoolFactory) -> None:
    for cpu_gloo, nothing in worker_pools(2).run(_applies):
        assert cpu_gloo and not nothing


def _big_ring(rank: int, numel: int, transport: str) -> Tensor:
    """Every rank sends a message several FIFOs long to the next while receiving the previous
    rank's: each send completes only while its rank also drains its receive."""
    _transport(transport)
    return ring_shift(torch.arange(float(numel)) + rank * numel)


@both
def test_messages_longer_than_the_fifo_cross_both_ways(worker_pools: PoolFactory, transport: str) -> None:
    n, numel = 3, 3 * 2**20  # 12 MiB each, 12 turns of a 1 MiB FIFO
    for rank, got in enumerate(worker_pools(n).run(_big_ring, numel, transport, env=TRANSPORTS[transport])):
        assert torch.equal(got, torch.arange(float(numel)) + ((rank - 1) % n) * numel)


def _mismatch(rank: int) -> str:
    _transport("shm")
    if rank == 0:
        batch_isend_irecv([(torch.ones(300), 1)], []).wait()  # 1200 bytes
        return "sent"
    try:
        batch_isend_irecv([], [(torch.empty(200), 0)]).wait()  # a buffer of 800
    except RuntimeError as exc:
        return str(exc)
    return "received"


def test_a_receive_of_the_wrong_size_fails_naming_both() -> None:
    from tessera.comm.testing import WorkerPool

    with WorkerPool(2) as pool:  # its pair is left broken: a pool of its own
        sent, error = pool.run(_mismatch, env=TRANSPORTS["shm"])
    assert sent == "sent"
    assert "1200 bytes" in error and "800 bytes" in error, error


_TCP_CYCLE = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from tessera.comm import batch_isend_irecv
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=30))
nxt, prv = (rank + 1) % 3, (rank - 1) % 3
out = batch_isend_irecv([(torch.full((3,), float(rank)), nxt)], [])
time.sleep(1.0)  # the link to the next rank is now waiting in the store for that rank
got = batch_isend_irecv([], [(torch.empty(3), prv)]).wait()[0]
out.wait()
assert torch.equal(got, torch.full((3,), float(prv))), got
print("ok", rank)
"""


def test_links_of_three_ranks_on_a_tcp_store_connect_in_a_cycle() -> None:
    """As under torchrun, the store is a TCPStore whose client serves one call at a time. Each
    rank first posts to the next rank, and only a second later receives from the previous
    one: the first link of every rank waits in the store for a peer whose first link is
    another pair's, so a link connecting over the rank's shared client holds the second
    link's address back and the three wait on each other (until the 30 s timeout)."""
    import os
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = {**os.environ, "TESSERA_SHM": "0", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TCP_CYCLE, str(rank), str(server.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]  # a bound on the wait, not a measurement
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0 and f"ok {rank}" in text, (
            f"rank {rank} exited {p.returncode}: {text[-3000:]}"
        )


def _first_message_beside_a_collective(
    rank: int, transport: str
) -> tuple[Tensor | None, Tensor | None, bool, bool]:
    """Rank 0 sends on a new group before the group's first collective, rank 1 receives after
    it; then both call `share_memory` on the group and exchange one more message."""
    import torch.distributed as dist

    from tessera.comm import all_reduce, shm_p2p

    group = dist.new_group([0, 1])
    x = torch.arange(6.0)
    got: Tensor | None = None
    if rank == 0:
        sent = batch_isend_irecv([(x, 1)], [], group)
        all_reduce(torch.ones(1), group)
        sent.wait()
    else:
        all_reduce(torch.ones(1), group)  # this rank's first collective on the group comes first
        got = batch_isend_irecv([], [(torch.empty_like(x), 0)], group).wait()[0]
    before = shm_p2p.applies([x], group)
    shared = share_memory(group)
    assert shared == shm_p2p.applies([x], group) == (transport == "shm"), (shared, transport)
    again: Tensor | None = None
    if rank == 0:
        batch_isend_irecv([(2 * x, 1)], [], group).wait()
    else:
        again = batch_isend_irecv([], [(torch.empty_like(x), 0)], group).wait()[0]
    return got, again, before, shared


@both
def test_a_collective_does_not_switch_a_groups_messages_only_share_memory_does(
    worker_pools: PoolFactory, transport: str
) -> None:
    """Ranks reach a group's first collective at different points: had it switched the group's
    messages to shared memory, rank 1 (after it) would wait in a FIFO for a message rank 0
    (before it) sent over a link."""
    per_rank = worker_pools(2).run(_first_message_beside_a_collective, transport, env=TRANSPORTS[transport])
    (_, _, before0, shared0), (got, again, before1, shared1) = per_rank
    x = torch.arange(6.0)
    assert got is not None and torch.equal(got, x)
    assert again is not None and torch.equal(again, 2 * x)
    assert not before0 and not before1
    assert shared0 == shared1 == (transport == "shm")
