"""The link model's all-to-all: the ring form by default, a measured all-to-all when the link
carries one (``Cluster.a2a_latency`` / ``a2a_bandwidth``), and only Ulysses configurations pay
it; a flat (shared-memory) link pays two latencies per collective call whatever the group's
size. Pure (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.planner import PRESETS, Cluster, Job, Layout, ModelShape, check, estimate
from tessera.planner.links import Link

JOB = Job(ModelShape(layers=2, hidden=64, heads=4, vocab=64, seq=32, batch=8))


def _config(**parallel: object) -> Layout:
    return Layout(**{"microbatches": 1, "zero": 1, **parallel})  # type: ignore[arg-type]


def _step(layout: Layout, cluster: Cluster) -> float:
    assert check(layout, JOB) == []
    return estimate(layout, JOB, cluster).time.total


@given(
    n=st.integers(1, 64),
    nbytes=st.floats(0, 1e10),
    lat=st.floats(1e-7, 1e-2),
    bw=st.floats(1e6, 1e12),
)
def test_all_to_all_is_the_ring_form_unless_measured(n: int, nbytes: float, lat: float, bw: float) -> None:
    plain = Link(2e-4, 0.85e9)
    assert plain.all_to_all(nbytes, n) == plain.ring_phase(nbytes, n)
    measured = Link(2e-4, 0.85e9, lat, bw)
    want = 0.0 if n == 1 else (n - 1) * lat + (n - 1) / n * nbytes / bw
    assert measured.all_to_all(nbytes, n) == pytest.approx(want, rel=1e-12)
    assert measured.ring_phase(nbytes, n) == plain.ring_phase(nbytes, n)  # other collectives unchanged


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_measured_all_to_all_equal_to_the_link_predicts_as_the_ring_form(world: int) -> None:
    """Wiring: a cluster whose measured all-to-all costs what the link's own form costs (on the
    ``cpu`` preset's flat links, one call of two latencies among the 2 ranks of the context
    group) predicts every step exactly as one without."""
    base = dataclasses.replace(PRESETS["cpu"], devices_per_node=2, a2a_latency=0.0, a2a_bandwidth=0.0)
    same = dataclasses.replace(base, a2a_latency=2 * base.intra_latency, a2a_bandwidth=base.intra_bandwidth)
    config = _config(dp=world // 2, cp=2, cp_mode="ulysses")
    assert _step(config, same) == pytest.approx(_step(config, base), rel=1e-12)


def test_a_slower_all_to_all_costs_ulysses_only() -> None:
    base = dataclasses.replace(PRESETS["cpu"], a2a_latency=0.0, a2a_bandwidth=0.0)
    slow = dataclasses.replace(
        base, a2a_latency=4 * base.intra_latency, a2a_bandwidth=base.intra_bandwidth / 4
    )
    ulysses = _config(cp=2, cp_mode="ulysses")
    assert _step(ulysses, slow) > _step(ulysses, base)
    for unaffected in (_config(cp=2), _config(dp=2), _config(tp=2, sequence_parallel=True)):
        assert _step(unaffected, slow) == _step(unaffected, base)


@given(
    n=st.integers(1, 64),
    nbytes=st.floats(0, 1e10),
    lat=st.floats(1e-7, 1e-2),
    bw=st.floats(1e6, 1e12),
)
def test_a_flat_link_pays_two_latencies_per_call_whatever_the_group(
    n: int, nbytes: float, lat: float, bw: float
) -> None:
    flat, ring = Link(lat, bw, flat=True), Link(lat, bw)
    if n == 1:
        assert flat.all_reduce(nbytes, n) == flat.ring_phase(nbytes, n) == flat.broadcast(nbytes, n) == 0.0
        return
    share = (n - 1) / n * nbytes / bw
    assert flat.ring_phase(nbytes, n) == pytest.approx(2 * lat + share, rel=1e-12)
    assert flat.all_reduce(nbytes, n) == pytest.approx(2 * lat + 2 * share, rel=1e-12)
    assert flat.broadcast(nbytes, n) == pytest.approx(2 * lat + nbytes / bw, rel=1e-12)
    assert ring.ring_phase(nbytes, n) == pytest.approx((n - 1) * lat + share, rel=1e-12)
    assert flat.call(7) == 2 * lat and ring.call(7) == 7 * lat


def test_the_measured_all_to_all_must_be_a_number() -> None:
    with pytest.raises(ValueError, match="a2a_bandwidth"):
        Cluster(a2a_bandwidth=-1.0)
