"""The chunk manager's pure pieces, property-tested: chunk plans and placement under budgets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.zero.chunks import Tier, plan_chunks
from tessera.zero.chunks.policy import Capacities, capacities, place


@given(st.lists(st.integers(0, 500), min_size=1, max_size=6), st.integers(1, 300))
def test_plan_chunks_covers_every_shard_element_once(shards: list[int], numel: int) -> None:
    plan = plan_chunks(shards, numel)
    for fi, n in enumerate(shards):
        mine = [(lo, hi) for f, lo, hi in plan if f == fi]
        assert [lo for lo, _ in mine] == list(range(0, n, numel))
        assert all(0 < hi - lo <= numel for lo, hi in mine)
        assert (mine[-1][1] if mine else 0) == n


@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=30),
    st.integers(0, 5000),
    st.one_of(st.none(), st.integers(0, 5000)),
    st.booleans(),
)
def test_place_fills_fast_tiers_first_within_capacity(
    sizes: list[int], device: int, host: int | None, disk: bool
) -> None:
    caps = Capacities(device=device, host=host, disk=None if disk else 0)
    room = device + (float("inf") if host is None else host) + (float("inf") if disk else 0)
    if sum(sizes) > room:
        with pytest.raises(ValueError, match="the model data needs"):
            place(sizes, caps)
        return
    try:
        tiers = place(sizes, caps)
    except ValueError as e:  # total fits but a chunk fits no gap left
        assert "fits on no tier" in str(e)
        return
    used = {t: sum(n for n, u in zip(sizes, tiers, strict=True) if u is t) for t in Tier}
    assert used[Tier.DEVICE] <= device
    assert host is None or used[Tier.HOST] <= host
    assert disk or used[Tier.DISK] == 0
    for n, t in zip(sizes, tiers, strict=True):  # a chunk went slower only when faster tiers lacked room
        if t is not Tier.DEVICE:
            assert used[Tier.DEVICE] + n > device or n > device


def test_capacities_refuse_a_budget_below_the_working_set() -> None:
    message = (
        r"host_budget_mb=0.5 cannot hold the working set: 1 MiB of staging for disk chunks in flight = 1 MiB"
    )
    with pytest.raises(ValueError, match=message):
        capacities(device_budget=None, host_budget=2**19, disk=True, staging=2**20)
    with pytest.raises(ValueError, match="measured non-model memory"):
        capacities(device_budget=None, host_budget=10_000, disk=False, staging=0, reserve_host=20_000)
