"""Tier 0: what `search` promises, checked against an exhaustive enumeration of every layout
`check` accepts (the oracle: no pruning, no shortcuts), and against the search itself at
other settings.

- Every ranked candidate is valid (`check` and the caller's ``validate`` report nothing),
  uses exactly the requested world, fits, carries `estimate`'s own prediction, and the
  ranking is by predicted step time (then device memory); every too-big one does not fit.
- Complete: without the ``keep`` cut-off the search ranks, at every ZeRO stage, every
  layout of the enumeration that fits (in the search's canonical form: one context mode
  and no sequence parallelism where there is nothing to split, a 2.5D grid only with depth
  and side both above 1); with any ``keep`` its best is the enumeration's best.
- Its restrictions hold: tensor-parallel modes, recompute values, chunks per rank.
- A device too small leaves nothing ranked and says how much was refused where.

Exact (``==``): the search and `estimate` run the same arithmetic. Pure (no processes).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.pipeline import SCHEDULES, schedule_spec
from tessera.planner import PRESETS, Cluster, Job, Layout, ModelShape, check, estimate, search
from tessera.planner.estimate import memory_floor, shape_of
from tessera.planner.search import divisors

JOB = Job(ModelShape(layers=2, hidden=32, heads=4, vocab=64, seq=16, batch=8))
A100 = PRESETS["a100-80g"]
# a device that holds some layouts and not others: what dp=4 holds at ZeRO-1
TIGHT = dataclasses.replace(
    A100, memory_gib=estimate(Layout(dp=4, microbatches=1, zero=1), JOB, A100).memory.device / 2**30
)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 5000))
def test_divisors_are_every_divisor_once_ascending(n: int) -> None:
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def _grids(tp: int) -> list[tuple[str, int]]:
    """Every (mode, depth) of ``tp`` ranks in canonical form (`check` refuses the rest)."""
    if tp == 1:
        return [("1d", 1)]
    grids = [("1d", 1), ("2d", 1), ("3d", 1)]
    return grids + [("2.5d", d) for d in divisors(tp)[1:] if tp // d > 1]


def enumerate_layouts(job: Job, world: int, max_chunks: int = 4) -> list[Layout]:
    """Every layout of ``world`` ranks `check` accepts, at ZeRO stage 0 without offload, in
    canonical form (see the module docstring); the pipeline must cut the model."""
    found = []
    for tp, cp, pp in itertools.product(divisors(world), repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for (mode, depth), name, v, m in itertools.product(
            _grids(tp),
            sorted(SCHEDULES) if pp > 1 else ["1f1b"],
            range(1, max_chunks + 1),
            divisors(job.model.batch),
        ):
            for sp, cp_mode in itertools.product(
                (False, True) if mode == "1d" and tp > 1 else (False,),
                ("ring", "ulysses") if cp > 1 else ("ring",),
            ):
                layout = Layout(
                    dp=dp, pp=pp, tp=tp, cp=cp, tp_mode=mode, tp_depth=depth, sequence_parallel=sp,
                    cp_mode=cp_mode, schedule=name, virtual_stages=v, microbatches=m,
                )  # fmt: skip
                if not check(layout, job) and shape_of(layout, job.model, A100, job.precision):
                    found.append(layout)
    return found


def _fitting(job: Job, cluster: Cluster, world: int) -> dict[Layout, float]:
    """Every enumerated layout at every ZeRO stage that fits, with or without offload (key:
    without, contiguous context chunks), and its fastest fitting step time."""
    best: dict[Layout, float] = {}
    for layout in enumerate_layouts(job, world):
        for zero, offload in itertools.product(range(4), (False, True)):
            found = estimate(dataclasses.replace(layout, zero=zero, offload=offload), job, cluster)
            if found.fits(cluster):
                key = dataclasses.replace(layout, zero=zero)
                best[key] = min(best.get(key, found.time.total), found.time.total)
    return best


def _key(layout: Layout) -> Layout:
    return dataclasses.replace(layout, offload=False, cp_layout=ContextLayout.CONTIGUOUS)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_search_is_complete_and_its_best_is_the_enumerations(world: int) -> None:
    """Without a cut-off the search ranks exactly the enumeration's fitting layouts (each
    stage once: without offload when that fits, else with), and with ``keep = 1`` or ``3`` its
    first candidates are the enumeration's fastest (the pruning loses none of them)."""
    oracle = _fitting(JOB, TIGHT, world)
    assert oracle, "the device holds something"
    everything = search(JOB, TIGHT, world=world, keep=10**9)
    assert {_key(c.layout) for c in everything.ranked} == set(oracle)
    assert len(everything.ranked) == len(oracle)
    for c in everything.ranked:
        if c.layout.offload:  # offload only where the same layout without it does not fit
            assert not estimate(dataclasses.replace(c.layout, offload=False), JOB, TIGHT).fits(TIGHT)
    fastest = sorted(oracle.values())
    for keep in (1, 3):
        got = search(JOB, TIGHT, world=world, keep=keep).ranked[:keep]
        assert [c.step_time for c in got] == fastest[:keep]


def test_a_small_keep_finds_the_fastest_pipeline() -> None:
    """The caller accepts only two-stage pipelines: the fastest (pp2 zb-h1 m2 ZeRO-0,
    2.4058e-4 s) is found at ``keep = 1`` too (an overestimating bound once ranked a
    2.4129e-4 s layout first)."""
    job = Job(ModelShape(layers=4, hidden=32, heads=4, vocab=50000, seq=16, batch=16))
    cluster = A100.with_world(64)

    def pipelines(layout: Layout) -> list[str]:
        return [] if layout.pp == 2 else [f"pp={layout.pp} refused"]

    everything = search(job, cluster, world=2, keep=10**9, validate=pipelines)
    best = search(job, cluster, world=2, keep=1, validate=pipelines).best
    assert everything.best is not None and best is not None
    assert best.step_time == everything.best.step_time


@st.composite
def searches(draw: st.DrawFn) -> tuple[Job, Cluster, dict[str, object]]:
    model = ModelShape(
        layers=draw(st.integers(1, 4)),
        hidden=draw(st.sampled_from([32, 64])),
        heads=4,
        vocab=draw(st.sampled_from([64, 1000])),
        seq=draw(st.sampled_from([16, 32])),
        batch=draw(st.sampled_from([4, 6, 8])),
    )
    job = Job(model, draw(st.sampled_from(["fp32", "bf16"])), draw(st.sampled_from(["adamw", "sgd"])))
    memory = draw(st.sampled_from([80.0, 0.05, 0.005, 0.0005]))
    cluster = dataclasses.replace(A100, memory_gib=memory, devices_per_node=draw(st.sampled_from([2, 8])))
    modes = draw(st.sampled_from([("1d",), ("1d", "2d"), ("1d", "2d", "2.5d", "3d")]))
    kw = {
        "world": draw(st.sampled_from([1, 2, 3, 4])),
        "tp_modes": modes,
        "max_chunks": draw(st.integers(1, 3)),
        "recompute": draw(st.sampled_from([(False,), (True,), (False, True)])),
        "keep": draw(st.sampled_from([1, 5, 50])),
    }
    return job, cluster, kw


def _heads_split(layout: Layout) -> list[str]:
    """A caller's rule that depends on the tensor-parallel shape only (heads must split)."""
    return [f"tp={layout.tp} does not divide 4 heads"] if 4 % layout.shape.grid.width_split else []


@settings(max_examples=25, deadline=None)
@given(case=searches(), picky=st.booleans())
def test_every_ranked_candidate_is_valid_fits_and_is_ranked_by_its_estimate(
    case: tuple[Job, Cluster, dict[str, object]], picky: bool
) -> None:
    job, cluster, kw = case
    validate = _heads_split if picky else None
    result = search(job, cluster, validate=validate, **kw)  # type: ignore[arg-type]
    world, modes, chunks, recompute = kw["world"], kw["tp_modes"], kw["max_chunks"], kw["recompute"]
    assert result.best == (result.ranked[0] if result.ranked else None)
    order = [(c.step_time, c.estimate.memory.device) for c in result.ranked]
    assert order == sorted(order)
    assert len({c.layout for c in result.ranked}) == len(result.ranked)
    for c in (*result.ranked, *result.too_big):
        p = c.layout
        assert check(p, job) == [] and (validate is None or validate(p) == [])
        assert p.world_size == world
        assert c.estimate == estimate(p, job, cluster)
        assert c.fits == c.estimate.fits(cluster) == (c.estimate.memory.device <= cluster.memory_bytes)
        assert p.tp == 1 or p.tp_mode.value in modes  # type: ignore[operator]
        assert p.recompute in recompute  # type: ignore[operator]
        assert schedule_spec(p.schedule).fixed_chunks or p.virtual_stages <= chunks  # type: ignore[operator]
        assert c.label() == p.label() and c.step_time == c.estimate.time.total and c.recompute == p.recompute
    assert all(c.fits for c in result.ranked) and not any(c.fits for c in result.too_big)
    sizes = [c.estimate.memory.device for c in result.too_big]
    assert sizes == sorted(sizes)
    assert min(result.invalid, result.pruned, result.layouts, result.overflow) >= 0


@settings(max_examples=40, deadline=None)
@given(case=searches(), data=st.data())
def test_the_memory_floor_is_below_every_stage_and_offload(
    case: tuple[Job, Cluster, dict[str, object]], data: st.DataObject
) -> None:
    """`memory_floor`, with which the search skips a layout that fits at no ZeRO stage, is at
    most the fullest rank's device bytes at every stage, with and without offload."""
    job, cluster, kw = case
    world = int(kw["world"])  # type: ignore[call-overload]
    layouts = enumerate_layouts(job, world, max_chunks=2)
    layout = data.draw(st.sampled_from(layouts))
    found = shape_of(layout, job.model, cluster, job.precision)
    assert found is not None
    floor = memory_floor(layout, found, job.precision, job.optimizer)
    for zero, offload in itertools.product(range(4), (False, True)):
        device = estimate(dataclasses.replace(layout, zero=zero, offload=offload), job, cluster).memory.device
        assert floor <= device * (1 + 1e-12), (zero, offload, floor, device)


def test_one_rank_has_one_parallel_layout() -> None:
    """World 1: every candidate is dp = pp = tp = cp = 1; they differ only in microbatches,
    ZeRO stage and recomputation."""
    result = search(JOB, A100, world=1, recompute=(False, True), keep=10**9)
    assert result.ranked
    assert {c.layout.degrees() for c in result.ranked} == {Layout().degrees()}
    assert {c.layout.microbatches for c in result.ranked} == set(divisors(JOB.model.batch))
    assert {c.layout.zero for c in result.ranked} == {0, 1, 2, 3}
    assert {c.recompute for c in result.ranked} == {False, True}


def test_a_device_too_small_ranks_nothing_and_counts_what_it_refused() -> None:
    """A device of one KiB: no layout fits, there is no best, and the refusals are counted
    (degree splits pruned, layouts that fit at no stage, evaluated candidates too big).
    The search does not refuse a world larger than the cluster: its ranks share nodes
    (`Cluster.ranks_per_node`), as on a CPU host."""
    tiny = dataclasses.replace(A100, memory_gib=2**-20)
    result = search(JOB, tiny, world=4)
    assert result.ranked == () and result.best is None
    assert result.pruned + result.overflow + len(result.too_big) > 0
    assert all(c.estimate.memory.device > tiny.memory_bytes for c in result.too_big)
    small = dataclasses.replace(A100, devices_per_node=2)
    crowded = search(JOB, small, world=8, tp_modes=("1d",))
    assert crowded.ranked and all(c.layout.world_size == 8 for c in crowded.ranked)
    assert small.ranks_per_node(8) == 8 and small.with_world(8).world_size == 8


def test_a_caller_refusing_every_tensor_shape_leaves_only_tp_one() -> None:
    """A rule that refuses every tp > 1 (whatever the rest): the search keeps tp = 1 only and
    counts the rest invalid."""

    def no_tp(layout: Layout) -> list[str]:
        return [f"tp={layout.tp} refused"] if layout.tp > 1 else []

    result = search(JOB, A100, world=4, validate=no_tp, keep=10**9)
    plain = search(JOB, A100, world=4, keep=10**9)
    assert result.ranked and all(c.layout.tp == 1 for c in result.ranked)
    assert [c for c in plain.ranked if c.layout.tp == 1] == list(result.ranked)
    assert result.invalid > plain.invalid
