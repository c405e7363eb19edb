"""How waits for CPU collectives poll before blocking (``tessera.comm.waiting``).

Tier 1 (pure): the budget from the environment, bounded polling over fake works that finish
late, never, or with an error. Tier 2: collectives on gloo worker processes (which set
``LOCAL_WORLD_SIZE``) give the same results polling and blocking, and a poll that never sees
completion falls through to the blocking wait.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.comm import all_gather_async, all_reduce_async, reduce_scatter_async
from tessera.comm.testing.fixtures import PoolFactory
from tessera.comm.waiting import AUTO_BUDGET_S, ENV, poll_budget, poll_then_wait

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
CORES = os.cpu_count() or 1


class FakeWork:
    """Completes after ``polls`` calls of is_completed (None: never before wait)."""

    def __init__(self, polls: int | None, error: Exception | None = None) -> None:
        self.polls, self.error = polls, error
        self.asked = 0
        self.waited = False

    def is_completed(self) -> bool:
        self.asked += 1
        return self.polls is not None and self.asked > self.polls

    def wait(self) -> object:
        self.waited = True
        if self.error is not None:
            raise self.error
        return None


def test_auto_polls_only_when_the_host_is_not_oversubscribed() -> None:
    assert poll_budget(CPU, {"LOCAL_WORLD_SIZE": str(CORES)}) == AUTO_BUDGET_S
    assert poll_budget(CPU, {"LOCAL_WORLD_SIZE": str(CORES + 1)}) == 0.0
    assert poll_budget(CPU, {}) == 0.0  # not launched by torchrun or a WorkerPool: block
    assert poll_budget(CPU, {ENV: "auto", "LOCAL_WORLD_SIZE": "1"}) == AUTO_BUDGET_S


@given(ms=st.floats(0, 1000, allow_nan=False))
def test_a_number_is_milliseconds(ms: float) -> None:
    assert poll_budget(CPU, {ENV: repr(ms), "LOCAL_WORLD_SIZE": str(CORES + 8)}) == pytest.approx(ms / 1000)


def test_gpu_waits_never_poll() -> None:
    assert poll_budget(CUDA, {ENV: "50", "LOCAL_WORLD_SIZE": "1"}) == 0.0


@pytest.mark.parametrize("raw", ["-1", "fast", "nan", ""])
def test_a_bad_value_is_refused_by_name(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV}='{raw}'"):
        poll_budget(CPU, {ENV: raw})


@given(polls=st.lists(st.integers(0, 50), min_size=1, max_size=4))
def test_polling_ends_when_every_work_completes_then_waits_each(polls: list[int]) -> None:
    works = [FakeWork(p) for p in polls]
    poll_then_wait(works, 10.0)
    assert all(w.waited for w in works)
    assert all(w.asked == p + 1 for w, p in zip(works, polls, strict=True))


def test_a_work_that_never_reports_falls_through_to_wait_after_the_budget() -> None:
    work = FakeWork(None)
    t0 = time.perf_counter()
    poll_then_wait([work], 0.01)
    assert work.waited and work.asked > 1
    assert time.perf_counter() - t0 < 5.0  # bounded (a generous bound: not a timing assertion)


def test_zero_budget_blocks_at_once_and_errors_propagate() -> None:
    work = FakeWork(3, RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        poll_then_wait([work], 0.0)
    assert work.asked == 0


def _collectives(rank: int, mode: str) -> list[torch.Tensor]:
    before = os.environ.get(ENV)
    os.environ[ENV] = mode
    try:
        x = torch.arange(12, dtype=torch.float32) * (rank + 1)
        handles = [all_reduce_async(x), all_gather_async(x), reduce_scatter_async(x)]
        return [h.wait() for h in handles]
    finally:  # the pool's processes serve later tests
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


@pytest.mark.parametrize("mode", ["auto", "0", "1000", "0.001"])
def test_collectives_equal_with_and_without_polling(worker_pools: PoolFactory, mode: str) -> None:
    """The pool sets LOCAL_WORLD_SIZE, so ``auto`` polls at world 2 on a 2-core machine; a
    budget of 1 us falls through to the blocking wait mid-collective. Exact: small integers."""
    results = worker_pools(2).run(_collectives, mode)
    base = torch.arange(12, dtype=torch.float32)
    for rank, (reduced, gathered, scattered) in enumerate(results):
        torch.testing.assert_close(reduced, base * 3, rtol=0, atol=0)
        torch.testing.assert_close(gathered, torch.cat([base, base * 2]), rtol=0, atol=0)
        torch.testing.assert_close(scattered, (base * 3).chunk(2)[rank], rtol=0, atol=0)
