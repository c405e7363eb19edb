"""Tier 0: the invariants of the planner's step time.

- The parts of a `StepTime` add up to its total and are never negative; one rank
  communicates nothing and its estimate does not depend on any link.
- A faster link (more bandwidth, less latency) never predicts a slower step; a bigger model
  (layers, width, vocabulary, sequence, batch) never a faster one.
- The pipeline's bubble is its own simulator's (``tessera.pipeline.simulate``) for every
  registered schedule, and GPipe's and 1F1B's ``(p - 1) / (m + p - 1)``.
- What the search prunes with holds: `Shape.bound` plus the step's overheads never exceeds
  the estimate, and the compute at ``m = 1`` bounds every microbatch count.
- The link model's collectives grow with bytes and latency and shrink with bandwidth; the
  operator and traffic tables give nothing extra to a serial model.

Exact unless stated; ``REL`` (1e-12) where the same quantity is reached by sums in another
order (a few roundings of doubles). No timing assertions: every "time" here is a prediction.
Pure (no processes).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessera.pipeline import SCHEDULES, Costs, build_schedule, fuse_adjacent, schedule_spec, simulate
from tessera.planner import PRESETS, Cluster, Job, Layout, ModelShape, TPShape, check, estimate
from tessera.planner.estimate import overheads, shape_of
from tessera.planner.links import Link
from tessera.planner.operators import OPS_EDGE, OPS_LAYER, operators
from tessera.planner.testing import jobs
from tessera.planner.traffic import Traffic, context_traffic, edge_traffic, tensor_traffic

REL = 1e-12
BATCH = 48
GRIDS = [("1d", 1, 1), ("1d", 2, 1), ("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]
CLUSTERS = {
    "a100": PRESETS["a100-80g"].with_world(64),
    "cpu": dataclasses.replace(PRESETS["cpu"], devices_per_node=4, node_flops=4 * PRESETS["cpu"].flops_fp32),
    "nodes": dataclasses.replace(PRESETS["h100-80g"], devices_per_node=2, nodes=32),  # groups cross nodes
}


JOBS = jobs(batch=BATCH)


@st.composite
def layouts(draw: st.DrawFn, *, pipelines: bool = True) -> Layout:
    """A layout `check` accepts for a batch of ``BATCH``."""
    mode, tp, depth = draw(st.sampled_from(GRIDS))
    pp = draw(st.sampled_from([1, 2, 4])) if pipelines else 1
    name = draw(st.sampled_from(sorted(SCHEDULES))) if pp > 1 else "1f1b"
    spec = schedule_spec(name)
    v = spec.default_chunks if spec.fixed_chunks else draw(st.integers(1, 2))
    dp = draw(st.sampled_from([1, 2, 3]))
    m = draw(st.sampled_from([m for m in (1, 2, 4, 8) if BATCH % (dp * m) == 0 and not spec.check(pp, m, v)]))
    layout = Layout(
        dp=dp,
        pp=pp,
        tp=tp,
        tp_mode=mode,
        tp_depth=depth,
        cp=draw(st.sampled_from([1, 2])),
        cp_mode=draw(st.sampled_from(["ring", "ulysses"])),
        sequence_parallel=mode == "1d" and tp > 1 and draw(st.booleans()),
        schedule=name,
        microbatches=m,
        virtual_stages=v,
        zero=draw(st.integers(0, 3)),
        offload=draw(st.booleans()),
        recompute=draw(st.booleans()),
    )
    return layout


def _total(layout: Layout, job: Job, cluster: Cluster) -> float:
    return estimate(layout, job, cluster).time.total


def _cuts(layout: Layout, job: Job) -> bool:
    """Whether the pipeline cuts the model (estimate raises for one it cannot)."""
    return shape_of(layout, job.model, CLUSTERS["a100"], job.precision) is not None


# ------------------------------------------------------------------ the parts of a step
@settings(max_examples=100, deadline=None)
@given(job=JOBS, layout=layouts(), where=st.sampled_from(sorted(CLUSTERS)))
def test_the_parts_of_a_step_are_not_negative_and_add_up(job: Job, layout: Layout, where: str) -> None:
    """Every part of a step is >= 0, they add up to the total (``==``: `StepTime.total`'s own
    sum), and a part is zero where its parallelism is absent."""
    assert check(layout, job) == []
    assume(_cuts(layout, job))
    cluster = CLUSTERS[where]
    found = estimate(layout, job, cluster)
    t = found.time
    parts = (t.compute, t.tensor_comm, t.bubble, t.data_comm, t.optimizer, t.crowding)
    assert all(x >= 0 for x in parts), parts
    assert t.total == t.compute + t.bubble + t.data_comm + t.optimizer + t.crowding
    assert t.tensor_comm <= t.compute * (1 + REL)  # the compute includes what it waits for
    assert 0.0 <= found.bubble_fraction < 1.0
    assert found.fits(cluster) == (found.memory.device <= cluster.memory_bytes)
    if layout.pp == 1:
        assert t.bubble == 0.0 and found.bubble_fraction == 0.0
    if layout.dp * layout.cp == 1:
        assert t.data_comm == 0.0  # no data-parallel group, no gradient traffic
    if layout.tp == layout.cp == 1:
        assert t.tensor_comm == 0.0


def _other_links(cluster: Cluster, k: float) -> Cluster:
    return dataclasses.replace(
        cluster,
        intra_bandwidth=cluster.intra_bandwidth * k,
        inter_bandwidth=cluster.inter_bandwidth * k,
        intra_latency=cluster.intra_latency / k,
        inter_latency=cluster.inter_latency / k,
        p2p_latency=cluster.p2p_latency / k,
        p2p_bandwidth=cluster.p2p_bandwidth * k,
        a2a_latency=cluster.a2a_latency / k,
        a2a_bandwidth=cluster.a2a_bandwidth * k,
    )


@settings(max_examples=60, deadline=None)
@given(
    job=JOBS, zero=st.integers(0, 3), offload=st.booleans(), recompute=st.booleans(), k=st.floats(0.01, 100)
)
def test_one_rank_communicates_nothing_and_no_link_changes_it(
    job: Job, zero: int, offload: bool, recompute: bool, k: float
) -> None:
    """World 1: no tensor, context or data-parallel traffic, no bubble, no crowding; and the
    whole estimate (memory and time) is the same on links k times faster or slower (``==``)."""
    layout = Layout(microbatches=4, zero=zero, offload=offload, recompute=recompute)
    for cluster in CLUSTERS.values():
        found = estimate(layout, job, cluster)
        t = found.time
        assert (t.tensor_comm, t.data_comm, t.bubble, t.crowding, found.bubble_fraction) == (0, 0, 0, 0, 0)
        assert t.total == t.compute + t.optimizer
        assert estimate(layout, job, _other_links(cluster, k)) == found


# ------------------------------------------------------------------ monotone
@settings(max_examples=100, deadline=None)
@given(
    job=JOBS,
    layout=layouts(),
    where=st.sampled_from(sorted(CLUSTERS)),
    k=st.floats(1.0, 1000.0),
)
def test_a_faster_link_never_predicts_a_slower_step(job: Job, layout: Layout, where: str, k: float) -> None:
    """Every bandwidth k times higher and every latency k times lower (intra- and inter-node,
    measured messages and all-to-alls): the step is no slower."""
    assume(_cuts(layout, job))
    cluster = CLUSTERS[where]
    slow, fast = _total(layout, job, cluster), _total(layout, job, _other_links(cluster, k))
    assert fast <= slow * (1 + REL), (slow, fast)


GROW = {
    "layers": lambda m: dataclasses.replace(m, layers=m.layers + 1),
    "hidden": lambda m: dataclasses.replace(m, hidden=2 * m.hidden),
    "vocab": lambda m: dataclasses.replace(m, vocab=3 * m.vocab),
    "seq": lambda m: dataclasses.replace(m, seq=2 * m.seq),
    "batch": lambda m: dataclasses.replace(m, batch=2 * m.batch),
    "mlp_ratio": lambda m: dataclasses.replace(m, mlp_ratio=m.mlp_ratio + 1),
}


@settings(max_examples=100, deadline=None)
@given(
    job=JOBS,
    layout=layouts(pipelines=False),
    where=st.sampled_from(sorted(CLUSTERS)),
    grow=st.sampled_from(sorted(GROW)),
)
def test_a_bigger_model_never_predicts_a_faster_step(job: Job, layout: Layout, where: str, grow: str) -> None:
    """Without a pipeline (whose cut moves with the model): one more layer, twice the width,
    three times the vocabulary, twice the sequence or the global batch, a wider MLP: every
    FLOP, byte and parameter grows, and so does the predicted step, never less."""
    bigger = dataclasses.replace(job, model=GROW[grow](job.model))
    assert check(layout, bigger) == []
    cluster = CLUSTERS[where]
    small, large = _total(layout, job, cluster), _total(layout, bigger, cluster)
    assert small <= large * (1 + REL), (small, large)


@settings(max_examples=60, deadline=None)
@given(job=JOBS, layout=layouts(pipelines=False), k=st.floats(1.0, 100.0))
def test_a_faster_device_never_predicts_a_slower_step(job: Job, layout: Layout, k: float) -> None:
    """FLOP/s and memory bandwidths k times higher: less to hide communication under, but
    never more than the compute saved. Without a pipeline: `timeline` rounds a pipeline's
    hop and backward to 0.1 forwards (documented), so a faster device can move a hop across
    a rounding boundary (pp=4, 2 layers of width 32 on the A100 preset: hop/f 0.249 -> 0.254
    rounds 0.2 -> 0.3, and twice the FLOP/s predict a 6% slower step)."""
    cluster = CLUSTERS["a100"]
    fast = dataclasses.replace(
        cluster,
        flops=cluster.flops * k,
        flops_fp32=cluster.flops_fp32 * k,
        memory_bandwidth=cluster.memory_bandwidth * k,
        host_bandwidth=cluster.host_bandwidth * k,
        host_memory_bandwidth=cluster.host_memory_bandwidth * k,
    )
    slow_t, fast_t = _total(layout, job, cluster), _total(layout, job, fast)
    assert fast_t <= slow_t * (1 + REL), (slow_t, fast_t)


@settings(max_examples=60, deadline=None)
@given(job=JOBS, layout=layouts(), where=st.sampled_from(sorted(PRESETS)))
def test_offload_never_makes_a_step_faster_on_a_preset(job: Job, layout: Layout, where: str) -> None:
    """What the search's shortcut (offload tried only when the layout without it does not
    fit) relies on: on every preset an offloaded optimizer step (PCIe copies, host memory)
    is never faster than one on the device."""
    assume(_cuts(layout, job))
    cluster = PRESETS[where].with_world(layout.world_size)
    on = _total(dataclasses.replace(layout, offload=True), job, cluster)
    off = _total(dataclasses.replace(layout, offload=False), job, cluster)
    assert off <= on * (1 + REL)


# ------------------------------------------------------------------ the pipeline's bubble
def _balanced(p: int, v: int, m: int) -> Job:
    """Every stage the same work to within 0.5% (the planner rounds stage scales to 0.01),
    and a hop under 5% of a forward (it rounds hops to 0.1 forwards): wide layers, a tiny
    vocabulary and sequence, four layers a stage, 8 sequences a microbatch; fp32 on the
    A100 preset."""
    return Job(ModelShape(layers=4 * p * v, hidden=1024, heads=8, vocab=8, seq=8, batch=8 * m))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (3, 6), (4, 4), (4, 8)])
def test_the_bubble_is_the_pipeline_simulators(name: str, p: int, m: int) -> None:
    """With every stage's work equal and messages instant, the predicted idle fraction is
    ``1 - busy / makespan`` of ``tessera.pipeline.simulate`` on the schedule as the runtime
    runs it (`fuse_adjacent`), F = B = W; rel 1e-12: the planner scales the same makespan
    to seconds and back."""
    spec = schedule_spec(name)
    v = spec.default_chunks
    if spec.check(p, m, v):
        pytest.skip(f"{name} refuses p={p}, m={m}: {spec.check(p, m, v)}")
    job = _balanced(p, spec.chunks(v), m)
    layout = Layout(pp=p, schedule=name, microbatches=m, virtual_stages=v)
    found = estimate(layout, job, PRESETS["a100-80g"])
    sim = simulate(fuse_adjacent(build_schedule(name, p, m, v)), Costs(f=1.0, b=1.0, w=1.0))
    assert found.bubble_fraction == pytest.approx(1 - max(sim.busy) / sim.makespan, rel=REL)
    assert found.time.bubble == pytest.approx(
        found.time.compute * (sim.makespan / max(sim.busy) - 1), rel=1e-9
    )
    if name in ("gpipe", "1f1b"):
        assert found.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=REL)


# ------------------------------------------------------------------ what the search prunes with
@settings(max_examples=100, deadline=None)
@given(job=JOBS, layout=layouts(), where=st.sampled_from(sorted(CLUSTERS)))
def test_the_compute_at_one_microbatch_bounds_every_count(job: Job, layout: Layout, where: str) -> None:
    """The search orders and cuts off layout families by their ``m = 1`` member's compute
    (``Shape.busy``): more microbatches never compute less (the same FLOPs and bytes, more
    launches and latencies), and no step is shorter than its compute."""
    cluster = CLUSTERS[where]
    found = shape_of(layout, job.model, cluster, job.precision)
    assume(found is not None)
    assert found is not None
    one = shape_of(dataclasses.replace(layout, microbatches=1), job.model, cluster, job.precision)
    if one is not None:
        assert one.busy <= found.busy * (1 + REL)
    assert found.busy <= _total(layout, job, cluster) * (1 + REL)


@settings(max_examples=100, deadline=None)
@given(job=JOBS, layout=layouts(pipelines=False), where=st.sampled_from(sorted(CLUSTERS)))
def test_without_a_pipeline_the_searchs_bound_never_exceeds_the_estimate(
    job: Job, layout: Layout, where: str
) -> None:
    """`Shape.bound` plus the step's data-parallel traffic and optimizer step (`overheads`)
    is at most the predicted step: what lets the search skip a layout without losing one of
    its ``keep`` fastest (rel 1e-12: the same terms, summed in another order)."""
    cluster = CLUSTERS[where]
    found = shape_of(layout, job.model, cluster, job.precision)
    assert found is not None
    bound = found.bound + sum(overheads(layout, job.precision, found, cluster))
    assert bound <= _total(layout, job, cluster) * (1 + REL)


# Found by hypothesis: a pipeline whose stages are unequal (a large vocabulary makes the head's
# stage the heaviest) finishes sooner than busy + (pp - 1) * f, f the *heaviest* chunk's
# forward (the bound `Shape.bound` once was; the first ranks' chunks are lighter).
HEAVY_HEAD = Job(ModelShape(layers=4, hidden=32, heads=4, vocab=50000, seq=16, batch=16))
BOUND_CASES = [
    Layout(pp=2, schedule="zb-h1", microbatches=2),  # the old bound 2.72e-4 s, step 2.41e-4 s
    Layout(pp=4, schedule="zb-h1", microbatches=2),  # the old bound 3.37e-4 s, step 2.44e-4 s
    Layout(pp=2, schedule="1f1b", microbatches=1),
]


@pytest.mark.parametrize("layout", BOUND_CASES, ids=lambda p: p.label())
def test_a_pipelines_bound_never_exceeds_its_estimate(layout: Layout) -> None:
    cluster = CLUSTERS["a100"]
    found = shape_of(layout, HEAVY_HEAD.model, cluster, HEAVY_HEAD.precision)
    assert found is not None
    bound = found.bound + sum(overheads(layout, HEAVY_HEAD.precision, found, cluster))
    assert bound <= _total(layout, HEAVY_HEAD, cluster) * (1 + REL)


# ------------------------------------------------------------------ links, operators, traffic
link_st = st.builds(
    Link,
    latency=st.floats(0, 1e-2),
    bandwidth=st.floats(1e6, 1e12),
    a2a_latency=st.floats(0, 1e-2),
    a2a_bandwidth=st.sampled_from([0.0, 1e8, 1e10]),
    p2p_latency=st.floats(0, 1e-2),
    p2p_bandwidth=st.sampled_from([0.0, 1e8, 1e10]),
    flat=st.booleans(),
)
COLLECTIVES = ("ring_phase", "all_reduce", "broadcast", "all_to_all")


@settings(max_examples=200, deadline=None)
@given(
    link=link_st,
    n=st.integers(1, 1024),
    nbytes=st.floats(0, 1e10),
    more=st.floats(0, 1e10),
    k=st.floats(1, 1e3),
)
def test_collectives_grow_with_bytes_and_latency_and_shrink_with_bandwidth(
    link: Link, n: int, nbytes: float, more: float, k: float
) -> None:
    """Every collective is free among one rank, never negative, no faster for more bytes,
    no slower over a link k times faster; an all-reduce is the faster of the ring's two
    phases and the tree; a message is never cheaper than its latency."""
    fast = dataclasses.replace(
        link,
        latency=link.latency / k,
        bandwidth=link.bandwidth * k,
        a2a_latency=link.a2a_latency / k,
        a2a_bandwidth=link.a2a_bandwidth * k,
        p2p_latency=link.p2p_latency / k,
        p2p_bandwidth=link.p2p_bandwidth * k,
    )
    for name in COLLECTIVES:
        cost = getattr(link, name)
        if n == 1:
            assert cost(nbytes, n) == 0.0
        assert 0.0 <= cost(nbytes, n) <= cost(nbytes + more, n) * (1 + REL)
        assert getattr(fast, name)(nbytes, n) <= cost(nbytes, n) * (1 + REL)
    if n > 1 and not link.flat:
        assert link.all_reduce(nbytes, n) <= 2 * link.ring_phase(nbytes, n) * (1 + REL)
    assert link.p2p(nbytes) >= (link.p2p_latency if link.p2p_bandwidth > 0 else link.latency)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("cp_mode", ["ring", "ulysses"])
def test_parallel_modes_launch_at_least_the_serial_operators(
    grid: tuple[str, int, int], cp_mode: str
) -> None:
    """A serial layout launches ``OPS_LAYER`` per layer and ``OPS_EDGE`` per edge (what the
    calibration fits the launch cost to); every parallel mode, sequence parallelism and
    context parallelism only adds; a 2D grid's extra grows with its side (``q / 2``)."""
    assert operators(Layout()) == (OPS_LAYER, OPS_EDGE)
    mode, tp, depth = grid
    layout = Layout(tp=tp, tp_mode=mode, tp_depth=depth)
    layer, edge = operators(layout)
    assert layer >= OPS_LAYER and edge >= OPS_EDGE
    with_cp = operators(dataclasses.replace(layout, cp=2, cp_mode=cp_mode))
    assert with_cp[0] > layer and with_cp[1] > edge
    if mode == "1d" and tp > 1:
        sp = operators(dataclasses.replace(layout, sequence_parallel=True))
        assert sp[0] > layer and sp[1] > edge
    small, large = operators(Layout(tp=4, tp_mode="2d")), operators(Layout(tp=16, tp_mode="2d"))
    assert large[0] - OPS_LAYER == pytest.approx(2 * (small[0] - OPS_LAYER), rel=REL)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.floats(0.5, 64),
    grid=st.sampled_from(GRIDS),
    cp=st.sampled_from([1, 2, 4]),
    cp_mode=st.sampled_from(["ring", "ulysses"]),
    link=link_st,
)
def test_tensor_and_context_traffic_vanish_alone_and_grow_with_the_rows(
    rows: float, grid: tuple[str, int, int], cp: int, cp_mode: str, link: Link
) -> None:
    """One tensor-parallel rank and one context rank move nothing; more rows (tokens) never
    move less; 1D moves two all-reduces of a layer's output each way (the backward's at the
    region entries, which may hide under compute); `Traffic` adds and scales part by part."""
    model = ModelShape(layers=2, hidden=64, heads=4, vocab=500, seq=32, batch=1)
    shape = TPShape(*grid)
    for f in (tensor_traffic, edge_traffic):
        assert f(model, rows, 4, TPShape(), link, cp=cp) == Traffic()
        one, two = f(model, rows, 4, shape, link, cp=cp), f(model, 2 * rows, 4, shape, link, cp=cp)
        for a, b in zip(dataclasses.astuple(one), dataclasses.astuple(two), strict=True):
            assert 0 <= a <= b * (1 + REL)
    assert context_traffic(model, rows, 4, 1, cp_mode, shape.tp, link) == Traffic()
    if shape.mode == "1d" and shape.tp > 1:
        y = rows * model.seq / cp * model.hidden * 4
        ar = link.all_reduce(y, shape.tp)
        assert tensor_traffic(model, rows, 4, shape, link, cp=cp) == Traffic(2 * ar, 0.0, 0.0, 2 * ar)
    t = Traffic(1.0, 2.0, 3.0, 4.0)
    assert t + t == t.scaled(2) == Traffic(2.0, 4.0, 6.0, 8.0)
