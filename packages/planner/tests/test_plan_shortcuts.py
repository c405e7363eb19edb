"""The search's shortcuts against what they stand for: a long pipeline timed without
validation or rows (`timed`), in its built or `unsplit` form, gives exactly
``tessera.pipeline.simulate``'s makespan, busy time and held activations (the launcher's
tests check that a tensor-parallel shape the search refuses whole holds no configuration
the launcher accepts). Pure (no processes)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.pipeline import SCHEDULES, Costs, build_schedule, fuse_adjacent, schedule_spec, simulate, unsplit
from tessera.pipeline.simulate import timed
from tessera.planner.bubble import _long

costs_st = st.builds(
    Costs,
    f=st.sampled_from([1.0]),
    b=st.floats(0.3, 3.0),
    w=st.floats(0.0, 2.0),
    p2p_latency=st.floats(0.0, 2.0),
    split=st.sampled_from([0.0, 0.4]),
)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.sampled_from([2, 3, 4, 8]),
    m=st.integers(1, 24),
    v=st.integers(1, 3),
    costs=costs_st,
    scaled=st.booleans(),
    whole=st.booleans(),
    data=st.data(),
)
def test_the_long_path_is_the_simulator_exactly(
    name: str, p: int, m: int, v: int, costs: Costs, scaled: bool, whole: bool, data: st.DataObject
) -> None:
    """The same timing model, equal to the last bit (``==``), for every registered schedule
    the registry accepts as the runtime runs it (or its unsplit form), with and without
    per-stage scales."""
    spec = schedule_spec(name)
    chunks = spec.default_chunks if spec.fixed_chunks else max(v, spec.min_chunks or 1)
    if spec.check(p, m, chunks):
        return  # the schedule refuses this shape; nothing to time
    schedule = build_schedule(name, p, m, chunks)
    schedule = unsplit(schedule) if whole else fuse_adjacent(schedule)
    if scaled:
        n = schedule.num_stages
        scale = data.draw(st.lists(st.floats(0.1, 2.0), min_size=n, max_size=n))
        costs = dataclasses.replace(costs, stage_scale=tuple(scale))
    want = simulate(schedule, costs)
    long, peaks = _long(name, p, m, chunks, whole)
    assert long == schedule
    makespan, busy, rows = timed(long, costs, rows=False)
    assert makespan == want.makespan and busy == want.busy and rows == [[] for _ in range(p)]
    assert peaks == tuple(float(x) for x in want.peak_held)
