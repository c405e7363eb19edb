"""Pytest fixtures for distributed tests; in a conftest.py: ``from tessera.comm.testing.fixtures import *``.

``worker_pools`` hands out one WorkerPool per world size, started on first use and kept for
the whole test session (closed at its end), so pool-based tests pay the start-up once.
A ``ci`` hypothesis profile (no deadline: distributed examples vary in time) is registered
and loaded unless another profile was chosen with ``--hypothesis-profile``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

from tessera.comm.testing.pool import WorkerPool

__all__ = ["PoolFactory", "worker_pools"]

PoolFactory = Callable[[int], WorkerPool]

settings.register_profile(
    "tessera",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.load_profile("tessera")


@pytest.fixture(scope="session")
def worker_pools() -> Iterator[PoolFactory]:
    """A function ``world_size -> WorkerPool``; each pool starts once per session."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
