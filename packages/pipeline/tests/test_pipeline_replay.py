"""`replay`: a schedule timed with the compute durations of a measured step (pure).

- replaying a simulated step without message latency gives back its makespan, for every
  registered schedule (the runtime's timelines have the same form as the simulator's);
- with latency the replay is the same step without it: never longer;
- a unit the runtime fused (one BW at its B, no W) replays as that BW at the B: the as-built
  split schedule replayed on its `unsplit` form's timelines takes the unsplit step;
- a schedule whose compute has no measured time is refused, naming the action.
Tolerances: sums of the same fp64 durations in another order (rel 1e-9).
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessera.pipeline import (
    SCHEDULES,
    ActionKind,
    Costs,
    build_schedule,
    replay,
    schedule_spec,
    simulate,
    unsplit,
)


def _costs(draw: st.DrawFn, stages: int, latency: float) -> Costs:
    scale = tuple(draw(st.floats(0.3, 3.0)) for _ in range(stages))
    f, b, w = (draw(st.floats(0.05, 4.0)) for _ in range(3))
    return Costs(f=f, b=b, w=w, split=draw(st.floats(0.0, 2.0)), stage_scale=scale, p2p_latency=latency)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 4), data=st.data())
def test_replaying_a_simulated_step_gives_its_makespan(name: str, p: int, data: st.DataObject) -> None:
    allowed = [m for m in range(1, 13) if not schedule_spec(name).check(p, m)]
    assume(allowed)
    m = data.draw(st.sampled_from(allowed), label="m")
    schedule = build_schedule(name, p, m)
    costs = _costs(data.draw, schedule.num_stages, 0.0)
    result = simulate(schedule, costs)
    assert replay(schedule, result.timeline) == pytest.approx(result.makespan, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["1f1b", "gpipe", "zb-h1", "zbv"]), p=st.integers(2, 4), m=st.integers(4, 8),
       data=st.data())
def test_replay_leaves_message_latency_out(name: str, p: int, m: int, data: st.DataObject) -> None:
    schedule = build_schedule(name, p, m)
    costs = _costs(data.draw, schedule.num_stages, data.draw(st.floats(0.01, 2.0)))
    slow = simulate(schedule, costs)
    instant = simulate(schedule, Costs(costs.f, costs.b, costs.w, 0.0, costs.stage_scale, costs.split))
    got = replay(schedule, slow.timeline)
    assert got == pytest.approx(instant.makespan, rel=1e-9)
    assert got <= slow.makespan * (1 + 1e-9)


@pytest.mark.parametrize(("name", "p", "m"), [("zb-h1", 2, 8), ("zb-h1", 4, 6), ("zbv", 2, 8), ("zbv", 3, 6)])
def test_a_fused_backward_replays_at_its_b(name: str, p: int, m: int) -> None:
    built = build_schedule(name, p, m)
    costs = Costs(f=1.0, b=1.3, w=0.9, stage_scale=tuple(1 + 0.1 * s for s in range(built.num_stages)))
    fused = simulate(unsplit(built), costs)  # what a runtime fusing every unit would record
    assert replay(built, fused.timeline) == pytest.approx(fused.makespan, rel=1e-9)


def test_a_compute_without_a_measured_time_is_named() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    forwards = [[t for t in row if t.action.kind is ActionKind.F] for row in simulate(schedule).timeline]
    with pytest.raises(ValueError, match="BW of microbatch 0, stage 0 of schedule 1f1b"):
        replay(schedule, forwards)
