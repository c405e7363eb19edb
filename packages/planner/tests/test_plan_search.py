"""The planner's search and estimate: a device too small leaves nothing that fits, more
sharding never predicts more model state, the pipeline extrapolation and per-stage costs
agree with the pipeline's simulator, a cluster TOML round-trips. Pure (no processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import TPMode
from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.pipeline import Costs, build_schedule, simulate, unsplit
from tessera.planner import (
    PRESETS,
    Cluster,
    Job,
    Layout,
    ModelShape,
    cluster_to_toml,
    estimate,
    load_cluster,
    search,
)
from tessera.planner.bubble import EXACT_LIMIT, pipeline_profile

SMALL = Job(ModelShape(layers=2, hidden=32, heads=4, vocab=64, seq=16, batch=8))


def test_a_device_too_small_leaves_only_configurations_that_do_not_fit() -> None:
    tiny = dataclasses.replace(PRESETS["cpu"], memory_gib=1e-6)
    result = search(SMALL, tiny, world=2)
    assert not result.ranked and result.best is None
    assert result.pruned + result.overflow + len(result.too_big) > 0


def test_more_sharding_never_predicts_more_model_state() -> None:
    states = []
    for stage in range(4):
        layout = Layout(dp=4, microbatches=1, zero=stage)
        states.append(estimate(layout, SMALL, PRESETS["cpu"]).memory.model_state)
    assert states == sorted(states, reverse=True) and states[0] > states[-1]


@pytest.mark.parametrize(
    ("name", "p", "v"),
    [("1f1b", 4, None), ("gpipe", 4, None), ("interleaved-1f1b", 4, 2), ("zb-h1", 4, None), ("zbv", 4, 2)],
)
def test_extrapolated_pipelines_match_the_simulator(name: str, p: int, v: int | None) -> None:
    """Past ``EXACT_LIMIT`` the profile is extrapolated from two small runs; for these
    schedules the steady state is exactly linear in m (same makespan to 1e-9)."""
    chunks = v or 1
    m = 20 * p
    assert p * m * chunks * 3 > EXACT_LIMIT
    got = pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0)
    want = simulate(build_schedule(name, p, m, v), Costs(f=1.0, b=1.0, w=1.0))
    assert got.extrapolated
    assert got.makespan == pytest.approx(want.makespan, rel=1e-9)
    assert got.peak_held == pytest.approx(tuple(float(x) for x in want.peak_held), rel=1e-9)


def test_cluster_toml_round_trips_and_names_unknown_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_to_toml(PRESETS["h100-80g"]))
    assert load_cluster(str(path)) == PRESETS["h100-80g"]
    path.write_text('[cluster]\npreset = "a100-80g"\nnodes = 4\n')
    assert load_cluster(str(path)).world_size == 32
    path.write_text("[cluster]\nbandwith = 1\n")
    with pytest.raises(ValueError, match="bandwith"):
        load_cluster(str(path))
    with pytest.raises(ValueError, match="devices_per_node"):
        Cluster(devices_per_node=0)


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["1f1b", "gpipe", "zb-h1"]),
    p=st.integers(2, 4),
    m=st.integers(4, 8),
    scale=st.lists(st.sampled_from([0.5, 1.0, 1.5]), min_size=4, max_size=4),
)
def test_stage_scales_time_each_stage_by_its_work(name: str, p: int, m: int, scale: list[float]) -> None:
    """Per-stage costs (the planner's imbalance model): every rank is busy exactly its own
    stages' work, equal scales are the unscaled schedule stretched, and the makespan lies
    between the unscaled schedule at the smallest and at the largest scale."""
    schedule = build_schedule(name, p, m)
    scales = tuple(scale[:p])
    got = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0, stage_scale=scales))
    for rank in range(p):
        assert got.busy[rank] == pytest.approx(3.0 * m * scales[rank])
    flat = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0)).makespan
    same = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0, stage_scale=(1.5,) * p)).makespan
    assert same == pytest.approx(1.5 * flat)
    assert min(scales) * flat - 1e-9 <= got.makespan <= max(scales) * flat + 1e-9


@pytest.mark.parametrize(("name", "p", "v"), [("zb-h1", 4, None), ("zbv", 2, 2)])
@pytest.mark.parametrize("m", [8, 80])  # exact, and past EXACT_LIMIT (the lean replay's steady runs)
def test_split_costs_and_unsplit_forms_match_the_simulator(name: str, p: int, v: int | None, m: int) -> None:
    """A split backward's extra (`Costs.split`) and the `unsplit` form time as the pipeline's
    own simulator does, through both of the planner's paths (same makespan to 1e-9)."""
    chunks, costs = v or 1, Costs(f=1.0, b=1.0, w=1.0, split=0.3)
    schedule = build_schedule(name, p, m, v)
    for whole, form in ((False, schedule), (True, unsplit(schedule))):
        got = pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0, split=0.3, whole=whole)
        want = simulate(form, costs)
        assert got.makespan == pytest.approx(want.makespan, rel=1e-9), (whole, got.extrapolated)
    plain = pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0)
    assert pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0, split=0.3).makespan > plain.makespan


def test_a_costly_split_slows_zero_bubble_and_tuning_caps_it() -> None:
    """``Cluster.split_overhead``: zero-bubble predicts slower with it; with ``tune_splits``
    (the runtime keeps only the splits that pay) never slower than the schedule unsplit,
    which for ZB-H1 is 1F1B's order: so never slower than 1F1B."""
    job = Job(dataclasses.replace(SMALL.model, layers=6, batch=16))
    layout = Layout(pp=2, microbatches=8, schedule="zb-h1", tune_splits=0)
    free, costly = PRESETS["cpu"], dataclasses.replace(PRESETS["cpu"], split_overhead=0.5)
    zero = dataclasses.replace(free, split_overhead=0.0)

    def step(lay: Layout, cluster: Cluster) -> float:
        return estimate(lay, job, cluster).time.total

    tuned = dataclasses.replace(layout, tune_splits=2)
    one_f = dataclasses.replace(layout, schedule="1f1b")
    assert step(layout, zero) < step(one_f, zero), "a free split: zero-bubble beats 1F1B"
    assert step(layout, costly) > step(layout, zero)
    assert step(tuned, costly) <= step(layout, costly)
    assert step(tuned, costly) == pytest.approx(step(one_f, costly), rel=1e-9)


def test_the_planners_own_check_refuses_what_it_cannot_model() -> None:
    """`check` (and `estimate` through it) names the values of a layout the planner cannot
    model; the search asks it of every layout, with or without a caller's ``validate``."""
    assert estimate(Layout(dp=2, microbatches=1), SMALL, PRESETS["cpu"]).time.total > 0
    with pytest.raises(ValueError, match=r"tp=2 is not a square q\*q: tp_mode 2d"):
        estimate(Layout(tp=2, tp_mode="2d", microbatches=1), SMALL, PRESETS["cpu"])
    with pytest.raises(ValueError, match=r"batch 8 is not divisible by dp \* microbatches = 3 \* 1 = 3"):
        estimate(Layout(dp=3, microbatches=1), SMALL, PRESETS["cpu"])
    with pytest.raises(ValueError, match=r"job\.precision='fp8'"):
        estimate(Layout(), dataclasses.replace(SMALL, precision="fp8"), PRESETS["cpu"])
    with pytest.raises(ValueError, match=r"layout\.cp_mode='ringg' is not one of ring, ulysses"):
        Layout(cp=2, cp_mode="ringg")
    assert Layout(tp=4, tp_mode="2d", cp_layout="zigzag") == Layout(
        tp=4, tp_mode=TPMode.TWO_D, cp_layout=ContextLayout.ZIGZAG
    )
    result = search(SMALL, PRESETS["cpu"], world=4)
    assert result.ranked and all(c.layout.world_size == 4 for c in result.ranked)


def test_a_callers_validate_removes_exactly_what_it_refuses() -> None:
    """The search with a ``validate`` that refuses every pipeline keeps exactly the candidates
    of the search without it that are not pipelines, in the same order and with the same
    predictions (``==``: the same arithmetic); the refused ones are counted as invalid."""
    cluster = PRESETS["cpu"]
    plain = search(SMALL, cluster, world=4, keep=1000)
    asked: list[Layout] = []

    def no_pipelines(layout: Layout) -> list[str]:
        asked.append(layout)
        return [f"pp={layout.pp} refused"] if layout.pp > 1 else []

    picky = search(SMALL, cluster, world=4, keep=1000, validate=no_pipelines)
    assert [c for c in plain.ranked if c.layout.pp == 1] == list(picky.ranked)
    assert any(c.layout.pp > 1 for c in plain.ranked) and picky.invalid > plain.invalid
    assert len(asked) == len(set(asked)), "each layout is validated once"
