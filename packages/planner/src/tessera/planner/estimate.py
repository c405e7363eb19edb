"""Predict one configuration: per-rank memory (`MemoryEstimate`) and step time (`StepTime`).

The configuration is a `Layout` of a `Job` (`tessera.planner.layout`). The model is
cut into ``[embed, *layers, head]`` blocks; the pipeline's own partitioner
(``partition_by_params``, the placement from the schedule's spec) gives each rank its stages,
exactly as ``boost()`` cuts them (`tessera.planner.cut`); the pipeline's simulator times the schedule
(`bubble`) with every stage's actions scaled by that stage's own work (the embedding and the
head make the first and last stages heavier), and each rank is busy for its own stages.

Step time = the pipeline's makespan (or ``m`` microbatches back to back without a pipeline)
with each microbatch-stage costing its FLOPs at the device's sustained rate, its operator
launches, and the tensor- and context-parallel communication that compute waits for; plus
the data-parallel / ZeRO gradient and parameter traffic that is not overlapped (stages 0-1
reduce after the last backward; stage 2 reduce-scatters during the last backward; stage 3
also all-gathers parameters before each forward and backward, prefetched under compute),
plus the optimizer step (streamed from device memory, or from the host after PCIe copies
with offload); on a CPU host whose ranks outnumber its cores, each rank's work (all of that
but its idle bubble) stretches by `Cluster.crowd` (``StepTime.crowding`` is what that adds).
Operators per layer and edge are each mode's own (`tessera.planner.operators`). Backward
costs twice the forward, split evenly between the input and weight gradients (what
zero-bubble schedules separate); recomputation adds one forward. A job with
experts (``Job.moe``, ``Layout.ep``) changes the dense estimate as `tessera.planner.experts`
says: their state in place of their layers' MLPs, and the all-to-alls of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from tessera.comm import Axis, Topology, TPMode
from tessera.pipeline import schedule_spec
from tessera.planner.bubble import EXACT_LIMIT, pipeline_profile
from tessera.planner.cluster import Cluster
from tessera.planner.cut import Cut, Kind, RankShare, cut_of
from tessera.planner.experts import expert_change
from tessera.planner.layout import Job, Layout, check
from tessera.planner.links import Link
from tessera.planner.memory import (
    DTYPE_BYTES,
    ActivationShape,
    MemoryEstimate,
    activation_bytes,
    model_state_bytes,
    shm_segment_bytes,
)
from tessera.planner.model import ModelShape
from tessera.planner.operators import operators
from tessera.planner.traffic import Traffic, context_traffic, edge_traffic, tensor_traffic
from tessera.planner.transient import (
    activations_3d,
    build_peak,
    gradient_peak,
    kept_grad_buffers,
    kept_gradients,
    step_scratch,
    summa_backward,
)
from tessera.zero.flat import BUCKET_BYTES

__all__ = [
    "Cut",
    "Estimate",
    "RankShare",
    "Shape",
    "StepTime",
    "cut_of",
    "estimate",
    "memory_floor",
    "overheads",
    "predict",
    "shape_of",
    "timeline",
]


@dataclass(frozen=True, slots=True)
class StepTime:
    """Seconds of one optimizer step, by where they go (they add up to ``total``)."""

    compute: float  # the busiest rank's forward and backward, communication of tp/cp included
    tensor_comm: float  # of which tensor- and context-parallel communication
    bubble: float  # pipeline idle time of the busiest rank
    data_comm: float  # data-parallel / ZeRO traffic not hidden under compute
    optimizer: float  # the optimizer step (and offload copies)
    crowding: float = 0.0  # what ranks sharing a node's cores add (`Cluster.crowd`)

    @property
    def total(self) -> float:
        """The predicted step time."""
        return self.compute + self.bubble + self.data_comm + self.optimizer + self.crowding


@dataclass(frozen=True, slots=True)
class Estimate:
    """A configuration's predicted memory (the fullest rank) and step time."""

    memory: MemoryEstimate
    time: StepTime
    psi: int  # parameter elements on the fullest rank
    bubble_fraction: float
    model_state: float = 0.0  # the most model-state bytes of any rank (the fullest by device
    # memory may hold less: a pipeline's head stage, whose logits outweigh the embedding)

    def fits(self, cluster: Cluster) -> bool:
        """Whether the fullest rank's device memory fits one device."""
        return self.memory.device <= cluster.memory_bytes


def _link(cluster: Cluster, span: int, world: int) -> Link:
    per_node = cluster.ranks_per_node(world)
    latency, bandwidth = cluster.link(span, per_node)
    inside = cluster.inside(span, per_node)
    measured: dict[str, float] = {}
    if cluster.a2a_bandwidth > 0:
        measured |= {"a2a_latency": cluster.a2a_latency, "a2a_bandwidth": cluster.a2a_bandwidth}
    if cluster.p2p_bandwidth > 0 and inside:
        measured |= {"p2p_latency": cluster.p2p_latency, "p2p_bandwidth": cluster.p2p_bandwidth}
    return Link(latency, bandwidth, **measured, flat=inside and cluster.shm_slots_bytes > 0)


@dataclass(frozen=True, slots=True)
class Shape:
    """Everything about a configuration that does not depend on its ZeRO stage: the heaviest
    chunk's forward ``f`` and backward ``bw`` seconds, the busiest rank's compute (each rank
    its own stages), each stage's work relative to the heaviest, the cut, and the activation
    bytes of one microbatch per layer, embedding and head."""

    f: float
    bw: float
    busy: float
    tensor_comm: float
    chunks: int
    hop: float
    cut: Cut
    act: tuple[float, float, float]  # (embedding, one layer, head)
    recompute_extra: float  # bytes of one layer's activations while it is recomputed
    scales: tuple[float, ...]  # each stage's work over the heaviest stage's (pipelines)
    backward_extra: float  # transient of the widest layer's backward (SUMMA's partials)
    kept_per_layer: float  # output gradients one layer keeps from B to W per microbatch (zero-bubble)
    message: float = 0.0  # bytes of one microbatch's layer input, whole (the tensor groups' largest)
    split: float = 0.0  # a split backward's extra over the backward (Cluster.split_overhead)

    @property
    def bound(self) -> float:
        """A lower bound on the estimated makespan under any schedule: the busiest rank's
        compute, ``busy`` (`timeline` scales the simulated makespan by ``busy`` over the
        simulated busy time, and a makespan is never shorter than a rank's busy time). The
        pipeline's fill is not added: with unequal stages the ranks before the busiest may be
        lighter than ``f``, and busy + (pp - 1) * f then exceeded the estimate (the search
        dropped the fastest pipeline)."""
        return self.busy

    def unit(self, kind: Kind) -> float:
        """Activation bytes one microbatch of a chunk of ``kind`` keeps for backward."""
        layers, embed, head = kind
        return layers * self.act[1] + embed * self.act[0] + head * self.act[2]


def shape_of(p: Layout, model: ModelShape, cluster: Cluster, precision: str) -> Shape | None:
    """The stage-independent part of a prediction (None when the pipeline cannot be cut:
    fewer blocks than stages, or chunks the schedule refuses); the ZeRO settings play no
    part (one cached shape serves every stage)."""
    if p.zero or p.offload:
        p = dataclasses.replace(p, zero=0, offload=False)
    return _shape_of(p, model, cluster, precision)


@functools.lru_cache(maxsize=1 << 17)
def _shape_of(p: Layout, model: ModelShape, cluster: Cluster, precision: str) -> Shape | None:
    c = DTYPE_BYTES[precision]
    recompute = p.recompute
    shape = p.shape
    world = p.world_size
    try:
        v = schedule_spec(p.schedule).chunks(p.virtual_stages) if p.pp > 1 else 1
        cut = cut_of(model, shape, p.pp, p.schedule, v)
    except ValueError:
        return None
    rows = model.batch / (p.dp * p.microbatches)
    split = ActivationShape(shape, p.sequence_parallel, p.cp, recompute)
    act = activation_bytes(model, rows, precision, split, layers=1)
    layer_3d = 0.0
    if shape.mode == "3d":  # gathered inputs and weights kept for backward (a recomputed layer: its input)
        q = shape.grid.side
        act[0], layer_3d, act[2] = activations_3d(model, rows, precision, q, p.cp)
        act[1] = act[1] if recompute else layer_3d
    rate = cluster.device_flops(precision)
    tokens = rows * model.seq
    tp_link, cp_link = _link(cluster, p.tp, world), _link(cluster, p.tp * p.cp, world)
    layer_tp = tensor_traffic(model, rows, c, shape, tp_link, cp=p.cp)
    heads_split = p.tp if shape.mode == "1d" else 1
    layer_cp = context_traffic(model, rows, c, p.cp, p.cp_mode, heads_split, cp_link)
    attention_s = 4.0 * tokens * model.seq * model.hidden / (p.tp * p.cp) / rate * cluster.overlap
    # 1D: each region entry's backward all-reduce runs beside the weight gradients of the
    # column layers reading it (tensor_parallel.overlap): q/k/v for attention, fc_in for the MLP
    entry = layer_tp.hidden_backward / 2
    wgrads = (3 * model.hidden * model.hidden, model.hidden * model.ffn)
    tp_exposed = sum(
        max(0.0, entry - 2.0 * tokens * n / (p.tp * p.cp) / rate * cluster.overlap) for n in wgrads
    )
    layer_comm = Traffic(layer_tp.forward, layer_tp.backward + (tp_exposed if entry else 0.0)) + Traffic(
        layer_cp.forward + max(0.0, layer_cp.hidden_forward - attention_s),
        layer_cp.backward + max(0.0, layer_cp.hidden_backward - 2 * attention_s),
    )
    edge_tp = edge_traffic(model, rows, c, shape, tp_link, cp=p.cp)
    ops_layer, ops_edge = operators(p)
    layer_s = model.layer_flops(tokens) / (p.tp * p.cp) / rate + ops_layer * cluster.op_overhead_s
    head_s = model.head_flops(tokens) / (p.tp * p.cp) / rate
    edge_s = ops_edge * cluster.op_overhead_s
    timed: dict[Kind, tuple[float, float, float]] = {}  # kind -> (forward, backward, comm)
    for kind in cut.kinds:
        layers, embed, head = kind
        edges = int(embed) + int(head)
        compute = layers * layer_s + edges * edge_s + head * head_s
        comm = layer_comm.scaled(layers) + edge_tp.scaled(edges)
        timed[kind] = (
            compute + comm.forward,
            (2 + recompute) * compute + comm.backward,
            comm.forward + comm.backward,
        )
    f = max(t[0] for t in timed.values())
    bw = max(t[1] for t in timed.values())
    heaviest = max(t[0] + t[1] for t in timed.values())
    # Each rank computes its own stages and the simulator scales each stage's actions by its
    # work, where the pipeline is simulated exactly; longer ones are extrapolated from runs
    # shared by every cut, with every stage at the heaviest's cost (`bubble.pipeline_profile`).
    exact = p.pp > 1 and p.pp * p.microbatches * v * 3 <= EXACT_LIMIT
    if exact or p.pp == 1:
        busy = max(sum(timed[k][0] + timed[k][1] for k in r.kinds) for r in cut.ranks)
    else:
        busy = v * (f + bw)
    comm_most = max(sum(timed[k][2] for k in r.kinds) for r in cut.ranks)
    scales = tuple(round((timed[k][0] + timed[k][1]) / heaviest, 2) for k in cut.stages) if exact else ()
    boundary = (
        rows
        * model.seq
        / p.cp
        * model.hidden
        * c
        / (p.tp if p.sequence_parallel or shape.mode != "1d" else 1)
    )
    extra = 0.0
    if recompute and model.layers:  # the layer being recomputed holds its activations in full
        full = ActivationShape(shape, p.sequence_parallel, p.cp, False)
        extra = layer_3d or activation_bytes(model, rows, precision, full, layers=1)[1]
    return Shape(
        f=f,
        bw=bw,
        busy=p.microbatches * busy,
        tensor_comm=comm_most * p.microbatches,
        scales=scales,
        chunks=v,
        hop=_link(cluster, world, world).p2p(boundary) if p.pp > 1 else 0.0,
        cut=cut,
        act=(act[0], act[1] if model.layers else 0.0, act[-1]),
        recompute_extra=extra,
        backward_extra=(
            summa_backward(model, rows, precision, shape.grid.side, p.tp_depth, p.cp)
            if shape.mode in ("2d", "2.5d")
            else 0.0
        ),
        kept_per_layer=kept_gradients(
            model, rows, precision, p.tp, p.sequence_parallel or shape.mode != "1d", p.cp
        ),
        message=rows * model.seq * model.hidden * c,
        split=cluster.split_overhead,
    )


def timeline(p: Layout, shape: Shape) -> tuple[float, float, tuple[float, ...], bool]:
    """(busy, makespan, peak held units per rank, whether W runs apart from B) of the
    pipeline, from the simulator; ratios to the forward are rounded to 0.1 so that
    near-identical pipelines share one simulation.

    A split backward costs ``shape.split`` of the backward more (`Costs.split`). With
    ``tune_splits`` the runtime keeps the fastest measured of the schedule as built, its
    `unsplit` form and `merge_splits` of it; the estimate takes the faster of the first two
    (a bound: the merge, when kept, was faster still). Memory is the schedule's as built:
    the runtime's first steps run it.
    """
    if p.pp == 1:
        return shape.busy, shape.busy, (1.0,), False
    ratio = round(shape.bw / 2 / shape.f, 1)
    hop = round(shape.hop / shape.f, 1)
    args = (p.schedule, p.pp, p.microbatches, shape.chunks, ratio, ratio, hop, shape.scales)
    built = pipeline_profile(*args)
    scale = shape.busy / built.busy  # the simulated busy time in seconds, exactly (no split cost)
    makespan = built.makespan
    if built.split_backward and shape.split > 0:
        makespan = pipeline_profile(*args, split=round(shape.split * 2 * ratio, 2)).makespan
        if p.tune_splits > 0:
            makespan = min(makespan, pipeline_profile(*args, whole=True).makespan)
    # memory: the schedule as built (the runtime's first steps run it, tuning or not)
    return shape.busy, makespan * scale, built.peak_held, built.split_backward


def one_reduction(p: Layout) -> bool:
    """Whether the engine reduces gradients once per step inside ``accumulating()``: under a
    pipeline or Megatron sequence parallelism."""
    return p.pp > 1 or p.sequence_parallel


def memory_floor(p: Layout, shape: Shape, precision: str, optimizer: str) -> float:
    """A lower bound on the fullest rank's device bytes over every ZeRO stage and offload
    (stage 3 with offload holds least): model state on the device plus one microbatch of its
    smallest chunk (every rank holds one at its peak)."""
    floor = 0.0
    for share in shape.cut.ranks:
        params, grads, state, host = model_state_bytes(
            share.psi,
            stage=3,
            n=p.dp * p.cp,
            precision=precision,
            offload=True,
            optimizer=optimizer,
            one_reduction=one_reduction(p),
        )
        least = params + grads + state - host + min(shape.unit(k) for k in share.kinds)
        floor = max(floor, least)
    return floor


def overheads(p: Layout, precision: str, shape: Shape, cluster: Cluster) -> tuple[float, float]:
    """(data-parallel / ZeRO traffic not hidden, optimizer step) in seconds: what a step adds
    to its pipeline's makespan (the gradients of the rank with most parameters set the pace)."""
    c = DTYPE_BYTES[precision]
    n = p.dp * p.cp
    world = n * p.pp * p.tp
    psi = max(share.psi for share in shape.cut.ranks)
    stage = 1 if one_reduction(p) and p.zero >= 2 else p.zero  # one reduce-scatter and all-gather at the step
    hide = cluster.overlap
    data_comm = _data_comm(
        stage, n, psi * c, _link(cluster, n * p.tp, world), hide * shape.f, hide * shape.bw, p.microbatches
    )
    shard = psi / (1 if p.zero == 0 else n)
    if p.offload:
        optimizer = shard * (4 + c) / cluster.host_bandwidth + shard * 28 / cluster.host_memory_bandwidth
    else:
        optimizer = shard * 28 / cluster.memory_bandwidth
    return data_comm, optimizer + 30 * cluster.op_overhead_s


def estimate(layout: Layout, job: Job, cluster: Cluster) -> Estimate:
    """Predict ``layout`` of ``job`` on ``cluster``; ValueError naming the values for a
    layout the planner cannot model (`check`) or a pipeline it cannot cut."""
    lines = check(layout, job)
    if lines:
        raise ValueError("; ".join(lines))
    return predict(layout, job, cluster)


def predict(p: Layout, job: Job, cluster: Cluster) -> Estimate:
    """`estimate` of a layout already checked (the search's)."""
    model, precision = job.model, job.precision
    c = DTYPE_BYTES[precision]
    shape = shape_of(p, model, cluster, precision)
    if shape is None:
        raise ValueError(f"layout {p.label()} cannot cut {model.layers + 2} blocks into its stages")
    busy, makespan, held, split_backward = timeline(p, shape)
    serial_total = float(sum(model.block_params()))
    tp_shape = p.shape
    tp_copies = float(sum(model.block_params(tp_shape)) - model.unsplit_params(tp_shape))
    n = p.dp * p.cp
    state_of: dict[tuple[int, int, int, int], tuple[float, ...]] = {}
    psi_f_of: dict[tuple[int, int, int, int], float] = {}
    worst: MemoryEstimate | None = None
    worst_psi = 0
    most_state = 0.0
    for rank, share in enumerate(shape.cut.ranks):
        key = (share.psi, share.blocks, share.largest, share.serial)
        if key not in state_of:
            flats = share.blocks if p.zero == 3 else max(1, math.ceil(share.psi * c / BUCKET_BYTES))
            psi_f = share.largest if p.zero == 3 else share.psi / flats
            state = model_state_bytes(
                share.psi,
                stage=p.zero,
                n=n,
                precision=precision,
                offload=p.offload,
                optimizer=job.optimizer,
                flats=flats,
                one_reduction=one_reduction(p),
            )
            buffers = 2.0 * share.largest * c if p.zero == 3 and not one_reduction(p) else 0.0
            buffers += shape.backward_extra
            buffers += kept_grad_buffers(share.psi, psi_f, flats, precision=precision, stage=p.zero)
            scratch = max(
                gradient_peak(
                    share.psi, psi_f, precision=precision, n=n, stage=p.zero, one_reduction=one_reduction(p)
                ),
                step_scratch(
                    psi_f,
                    precision=precision,
                    n=n,
                    stage=p.zero,
                    offload=p.offload,
                    optimizer=job.optimizer,
                ),
            )
            build = build_peak(
                serial_total, psi_f, precision=precision, n=n, stage=p.zero, tp_share=tp_copies
            )
            state_of[key] = (*state, buffers, scratch, build)
            psi_f_of[key] = psi_f
        params, grads, states, host, buffers, scratch, build = state_of[key]
        layers_held = max(k[0] for k in share.kinds)
        kept = held[rank] * layers_held * shape.kept_per_layer if split_backward else 0.0
        activations = held[rank] * max(shape.unit(k) for k in share.kinds) + shape.recompute_extra + kept
        shared = _shared(p, cluster, c * (share.largest if p.zero == 3 else psi_f_of[key]), shape.message)
        mem = MemoryEstimate(params, grads, states, host, activations, buffers, scratch, build, shared)
        most_state = max(most_state, mem.model_state)
        if worst is None or mem.device > worst.device:
            worst, worst_psi = mem, share.psi
    assert worst is not None
    data_comm, optimizer = overheads(p, precision, shape, cluster)
    time = StepTime(busy, shape.tensor_comm, makespan - busy, data_comm, optimizer)
    bubble = (makespan - busy) / makespan if makespan else 0.0
    if job.moe is not None:  # the experts' state in place of their layers' MLPs, the all-to-alls
        moe = expert_change(
            job.moe,
            model,
            dp=p.dp,
            ep=p.ep,
            microbatches=p.microbatches,
            stage=p.zero,
            tp=p.tp,
            offload=p.offload,
            precision=precision,
            optimizer=job.optimizer,
            link=_link(cluster, p.ep * p.tp, p.world_size),  # the ep group: ep dp ranks, tp apart
        )
        dp_, dg, ds, dh = moe.state
        worst = dataclasses.replace(
            worst,
            parameters=worst.parameters + dp_,
            gradients=worst.gradients + dg,
            optimizer_state=worst.optimizer_state + ds,
            host=worst.host + dh,
        )
        time = dataclasses.replace(
            time, compute=time.compute + moe.a2a, tensor_comm=time.tensor_comm + moe.a2a
        )
        worst_psi, most_state = worst_psi + moe.psi, most_state + dp_ + dg + ds
    # ranks sharing a node's cores: each one's work (its compute, collectives and optimizer
    # step; not its idle bubble) stretches, and the step takes at least that
    crowd = cluster.crowd(cluster.ranks_per_node(p.world_size))
    work = crowd * (time.compute + time.data_comm + time.optimizer)
    time = dataclasses.replace(time, crowding=max(0.0, work - time.total))
    return Estimate(worst, time, worst_psi, bubble, most_state)


def _shared(p: Layout, cluster: Cluster, flat: float, activation: float) -> float:
    """Resident bytes of the shared-memory segments one rank maps (`shm_segment_bytes`): the
    data-parallel group's, whose largest message is a flat buffer of ``flat`` bytes, and the
    context group's and each tensor-parallel group's (the mode's sub-axes: rows, columns,
    depth...), whose largest is a layer's ``activation``."""
    slots = cluster.shm_slots_bytes
    if slots <= 0:
        return 0.0
    mode = p.tp_mode
    topo = Topology(tp=p.tp, cp=p.cp, tp_mode=mode, tp_depth=p.tp_depth if mode is TPMode.TWO_P5_D else 1)
    tensor = [a for a in topo.axes if a.value.startswith("tp_")] or [Axis.TP]
    groups = [(p.dp * p.cp, flat), (p.cp, activation), *((topo.size(a), activation) for a in tensor)]
    return sum(shm_segment_bytes(n, message, slots) for n, message in groups)


def _data_comm(stage: int, n: int, nbytes: float, link: Link, f: float, bw: float, m: int) -> float:
    """Seconds of ZeRO / data-parallel traffic that compute does not hide."""
    norm = link.all_reduce(32, n)
    if n <= 1:
        return 0.0
    if stage == 0:
        return link.all_reduce(nbytes, n) + norm
    phase = link.ring_phase(nbytes, n)
    if stage == 1:
        return 2 * phase + norm
    if stage == 2:  # reduce-scatter under the last backward, all-gather after the step
        return max(0.0, phase - bw) + phase + norm
    per_microbatch = max(0.0, phase - f) + max(0.0, 2 * phase - bw)  # gathers prefetched under compute
    return m * per_microbatch + norm
