"""Tier 1: the restart model adds its four terms as its docstring says."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.planner import PRESETS, Job, Layout, ModelShape, estimate
from tessera.planner.restart import restart_cost

JOB = Job(
    ModelShape(layers=4, hidden=256, heads=4, vocab=1000, seq=128, batch=32768),
    precision="bf16",
    optimizer="adamw",
)


@given(
    watchdog=st.floats(1, 600),
    every=st.integers(1, 1000),
    relaunch=st.floats(0, 300),
    nodes=st.sampled_from([1, 2, 16, 128, 1024]),  # the batch splits over 8 ranks per node
    peer=st.booleans(),
)
def test_the_terms_follow_their_formulas(
    watchdog: float, every: int, relaunch: float, nodes: int, peer: bool
) -> None:
    cluster = PRESETS["a100-80g"].with_world(8 * nodes)
    one = estimate(Layout(dp=8 * nodes), JOB, cluster)
    cost = restart_cost(
        one, cluster, watchdog_s=watchdog, checkpoint_every=every, relaunch_s=relaunch, disk_bandwidth=2e9,
        store_message_s=1e-3, copy_from_peer=peer,
    )  # fmt: skip
    per_node = (one.memory.parameters + one.memory.optimizer_state) * cluster.devices_per_node
    load = per_node / 2e9 + (per_node / (cluster.inter_bandwidth * 8) if peer else 0.0)
    assert cost.detect == pytest.approx(watchdog + min(2.0, max(0.1, watchdog / 10)))
    assert cost.relaunch == pytest.approx(relaunch + cluster.nodes * 1e-3)
    assert cost.load == pytest.approx(load) and cost.redo == pytest.approx(every / 2 * one.time.total)
    assert cost.total == pytest.approx(cost.detect + cost.relaunch + cost.load + cost.redo)


def test_bad_values_are_refused_by_name() -> None:
    cluster = PRESETS["a100-80g"].with_world(8)
    one = estimate(Layout(dp=8), JOB, cluster)
    with pytest.raises(ValueError, match="checkpoint_every must be > 0, got 0"):
        restart_cost(one, cluster, watchdog_s=60, checkpoint_every=0, relaunch_s=10, disk_bandwidth=1e9)
    with pytest.raises(ValueError, match="disk_bandwidth must be > 0"):
        restart_cost(one, cluster, watchdog_s=60, checkpoint_every=10, relaunch_s=10, disk_bandwidth=0)
