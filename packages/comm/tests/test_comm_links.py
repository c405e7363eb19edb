"""Tier 2: CPU point-to-point over links (``tessera.comm.links``) on the gloo worker pool.

What the pipeline runtime and the gloo rings rely on: a link's handles report completion
without being waited on; messages of one (pair, tag) arrive in post order, whatever their
dtype and size; tags and directions are independent; and ranks may start talking in any
order (links connect in the background, so no rank blocks on a peer that is busy elsewhere).
"""

from __future__ import annotations

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import batch_isend_irecv, links
from tessera.comm.testing.fixtures import PoolFactory

DEADLINE_S = 60.0


def _polled_until_complete(rank: int, x: Tensor) -> tuple[Tensor | None, bool]:
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


def test_a_receive_reports_completion_without_being_waited_on(worker_pools: PoolFactory) -> None:
    x = torch.arange(10.0)
    _, (got, completed) = worker_pools(2).run(_polled_until_complete, x)
    assert completed, f"a link receive did not report completion within {DEADLINE_S} s"
    assert got is not None and torch.equal(got, x)


def _messages(rank: int, xs: list[Tensor], tags: list[int]) -> list[Tensor]:
    """Rank 0 posts every message alone (not waiting), then waits; rank 1 receives them in
    order, and sends each back doubled on the reverse link."""
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


@settings(max_examples=12, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6),
    tags=st.lists(st.integers(0, 3), min_size=6, max_size=6),
)
def test_messages_arrive_in_post_order_per_tag_any_dtype_and_size(
    worker_pools: PoolFactory, shapes: list[list[int]], dtypes: list[torch.dtype], tags: list[int]
) -> None:
    """Exact: the bytes travel unchanged. Empty tensors included (no message on the wire)."""
    xs = [(torch.randn(shape) * 100).to(dtypes[i]) for i, shape in enumerate(shapes)]
    back, got = worker_pools(2).run(_messages, xs, tags[: len(xs)])
    for i, x in enumerate(xs):
        assert torch.equal(got[i], x), f"message {i} ({x.dtype}, {tuple(x.shape)}) changed in transit"
        assert torch.equal(back[i], x + x), f"reply {i} ({x.dtype}, {tuple(x.shape)}) changed in transit"


def _cycle(rank: int, n: int) -> Tensor:
    """Each rank first sends to the next rank alone and waits, only then receives from the
    previous one: completes only if no rank blocks connecting to a peer busy elsewhere
    (torch's p2p allows this order, and so must links)."""
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    out = batch_isend_irecv([(torch.full((3,), float(rank)), nxt)], [])
    got = batch_isend_irecv([], [(torch.empty(3), prv)]).wait()[0]
    out.wait()
    return got


def test_ranks_may_start_talking_in_a_cycle(worker_pools: PoolFactory) -> None:
    n = 3
    for rank, got in enumerate(worker_pools(n).run(_cycle, n)):
        assert torch.equal(got, torch.full((3,), float((rank - 1) % n)))


def _applies(rank: int) -> tuple[bool, bool]:
    return links.applies([torch.ones(2)], None), links.applies([], None)


def test_links_carry_cpu_tensors_on_gloo_groups(worker_pools: PoolFactory) -> None:
    for cpu_gloo, nothing in worker_pools(2).run(_applies):
        assert cpu_gloo and not nothing
