"""`merge_splits`, `unsplit` and `fit_costs` (pure: schedules and the simulator, no processes).

- merging never lengthens the simulated step under the costs it was given, and the result
  is a valid schedule with the same stages;
- a split that costs far more than any idle time it could fill is merged everywhere (the
  result is `unsplit`'s), and a free split keeps zero-bubble's advantage over 1F1B;
- `fit_costs` recovers the costs of simulated timelines exactly (up to fp64 round-off:
  means of sums of the given durations; rel 1e-9).
- the runtime's tuner runs its forms in pairs of steps and keeps the one faster in the
  median pair (on a fake one-rank group);
- `fuse_adjacent` (what the runtime runs) fuses exactly the units whose W is the next
  computation after their B with nothing sent in between, keeps every message where it
  was, and never lengthens the step (the same step when the split is free).
The runtime running merged (mixed BW and B/W) schedules equal to the serial model is tested
in ``test_pipeline_runtime.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.pipeline import (
    ActionKind,
    Costs,
    Schedule,
    build_schedule,
    fit_costs,
    fuse_adjacent,
    merge_splits,
    simulate,
    unsplit,
    validate,
)

SPLIT = ["zb-h1", "zbv"]
positive = st.floats(0.05, 4.0)


@st.composite
def costs(draw: st.DrawFn, stages: int) -> Costs:
    raw = [draw(st.floats(0.3, 3.0)) for _ in range(stages)]
    mean = sum(raw) / stages
    return Costs(
        f=draw(positive),
        b=draw(positive),
        w=draw(positive),
        split=draw(st.floats(0.0, 2.0)),
        stage_scale=tuple(x / mean for x in raw),  # mean 1, as `fit_costs` normalises
    )


def kinds(schedule: Schedule) -> list[ActionKind]:
    return [a.kind for acts in schedule.actions for a in acts]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SPLIT), p=st.integers(1, 4), m=st.integers(1, 10), data=st.data())
def test_merging_never_lengthens_the_step(name: str, p: int, m: int, data: st.DataObject) -> None:
    schedule = build_schedule(name, p, m)
    c = data.draw(costs(schedule.num_stages))
    merged = merge_splits(schedule, c)
    validate(merged)
    assert (merged.name, merged.stage_to_rank, merged.num_microbatches) == (
        schedule.name,
        schedule.stage_to_rank,
        schedule.num_microbatches,
    )
    before, after = simulate(schedule, c).makespan, simulate(merged, c).makespan
    assert after <= before * (1 + 1e-9), f"merged {after} > split {before} under {c}"
    assert kinds(merged).count(ActionKind.W) <= kinds(schedule).count(ActionKind.W)


@pytest.mark.parametrize("name", SPLIT)
@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8)])
def test_a_costly_split_is_merged_everywhere(name: str, p: int, m: int) -> None:
    schedule = build_schedule(name, p, m)
    merged = merge_splits(schedule, Costs(split=1e3))
    assert merged == unsplit(schedule)
    assert ActionKind.W not in kinds(merged) and ActionKind.B not in kinds(merged)


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16)])
def test_a_free_split_keeps_the_zero_bubble_advantage(p: int, m: int) -> None:
    """Unit costs F = B = W = 1: ZB-H1's makespan ``3m + p - 1`` stays, below 1F1B's
    ``3(m + p - 1)``; the merge removes splits that change nothing."""
    unit = Costs()
    schedule = build_schedule("zb-h1", p, m)
    merged = merge_splits(schedule, unit)
    assert simulate(merged, unit).makespan == 3 * m + p - 1
    assert simulate(build_schedule("1f1b", p, m), unit).makespan == 3 * (m + p - 1)
    kept = kinds(merged).count(ActionKind.W)
    assert 0 < kept < p * m, f"{kept} of {p * m} splits kept"


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SPLIT), p=st.integers(1, 4), m=st.integers(1, 6), data=st.data())
def test_fit_costs_recovers_simulated_costs(name: str, p: int, m: int, data: st.DataObject) -> None:
    schedule = build_schedule(name, p, m)
    want = data.draw(costs(schedule.num_stages))
    timelines = [*simulate(schedule, want).timeline, *simulate(unsplit(schedule), want).timeline]
    got = fit_costs(timelines, schedule.num_stages)
    for field in ("f", "b", "w", "split"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9, abs=1e-12), field
    assert got.stage_scale == pytest.approx(want.stage_scale, rel=1e-9)


def test_fit_costs_names_a_stage_without_a_backward() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    forwards = [[t for t in row if t.action.kind is ActionKind.F] for row in simulate(schedule).timeline]
    with pytest.raises(ValueError, match="stage 0"):
        fit_costs(forwards, 2)


def _drive(tuner: Any, base: dict[str, float], costs: Costs, drift: float = 0.02) -> list[str]:
    """Step ``tuner`` as the runtime does, on a one-rank group: each step takes its form's
    ``base`` seconds times a drift that grows every step; timelines from the simulator."""
    ran: list[str] = []
    while not tuner.done:
        schedule = tuner.next_schedule(None)
        if tuner.done:
            break
        names = {id(s): n for n, s in tuner.forms.items()}
        form = names[id(schedule)]
        ran.append(form)
        timeline = [t for row in simulate(schedule, costs).timeline for t in row]
        tuner.record(timeline, base[form] * (1 + drift * len(ran)))
    return ran


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SplitTuner`'s gather on a group of one rank: every rank's figures are this rank's."""
    from tessera.pipeline import tune

    monkeypatch.setattr(tune, "group_size", lambda group: 1)
    monkeypatch.setattr(tune.dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(0, obj))


BENCH_COSTS = Costs(f=5.9e-3, b=6.2e-3, w=3.9e-3, split=1.9e-3, stage_scale=(0.89, 1.11))


def test_the_tuner_runs_its_forms_in_pairs_and_keeps_the_faster(one_rank: None) -> None:
    """Warm-ups, then as built / unsplit in pairs; the merge (new under these costs) against
    the better of the two, in pairs; the steps slow down by 2% each, which a comparison of
    blocks of steps would read as the later form being slower."""
    from tessera.pipeline.tune import SplitTuner, tuning_steps

    built = build_schedule("zb-h1", 2, 8)
    assert merge_splits(built, BENCH_COSTS) not in (built, unsplit(built)), "the merge must be new here"
    tuner = SplitTuner(built, steps=2)
    ran = _drive(tuner, {"as built": 1.0, "unsplit": 0.97, "merged": 0.95}, BENCH_COSTS)
    B, U, M = "as built", "unsplit", "merged"
    assert ran == [B, U, B, U, B, U, M, M, U, M, U]
    assert len(ran) == tuning_steps(2)
    assert tuner.form == M and tuner.chosen == merge_splits(built, BENCH_COSTS)
    assert set(tuner.step_seconds) == {B, U, M}


def test_the_tuner_chooses_after_the_first_pairs_when_the_merge_is_not_new(one_rank: None) -> None:
    """A split that costs more than any idle time merges everywhere: the merge is `unsplit`,
    so the faster of the first two is kept without more steps."""
    from tessera.pipeline.tune import SplitTuner

    built = build_schedule("zb-h1", 2, 4)
    costly = Costs(f=1.0, b=1.0, w=1.0, split=5.0)
    tuner = SplitTuner(built, steps=3)
    ran = _drive(tuner, {"as built": 0.9, "unsplit": 1.0}, costly, drift=0.0)
    assert ran == ["as built", "unsplit"] * 4
    assert tuner.form == "as built" and tuner.chosen == built


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SPLIT), p=st.integers(1, 4), m=st.integers(1, 10), data=st.data())
def test_fuse_adjacent_fuses_only_splits_that_free_nothing(
    name: str, p: int, m: int, data: st.DataObject
) -> None:
    built = build_schedule(name, p, m)
    fused = fuse_adjacent(built)
    validate(fused)
    assert fuse_adjacent(fused) == fused
    for rank, acts in enumerate(built.actions):
        p2p = [a for a in acts if not a.is_compute]
        assert [a for a in fused.actions[rank] if not a.is_compute] == p2p, f"rank {rank} moved messages"
        want = set()
        for i, a in enumerate(acts):
            if a.kind is ActionKind.B:
                after = acts[i + 1 :]
                nxt = next(b for b in after if b.is_compute)
                unit = (a.microbatch, a.stage)
                between = after[: after.index(nxt)]
                sent = any(b.kind is ActionKind.SEND_B and (b.microbatch, b.stage) == unit for b in between)
                if nxt.kind is ActionKind.W and (nxt.microbatch, nxt.stage) == unit and not sent:
                    want.add(unit)
        got = {(a.microbatch, a.stage) for a in fused.actions[rank] if a.kind is ActionKind.BW}
        assert got == want, f"rank {rank}: fused {sorted(got)}, want {sorted(want)}"
    cost = data.draw(costs(built.num_stages))
    free = Costs(cost.f, cost.b, cost.w, 0.0, cost.stage_scale, 0.0)
    assert simulate(fused, free).makespan == pytest.approx(simulate(built, free).makespan, rel=1e-9)
    assert simulate(fused, cost).makespan <= simulate(built, cost).makespan * (1 + 1e-9)
