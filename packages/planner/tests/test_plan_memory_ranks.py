"""Tier 0: the fullest rank of `estimate` as the parallel degrees grow, and the transient
terms (`tessera.planner.transient`) it adds to model state and activations.

- No more device bytes or model state as dp grows (the same global batch and microbatch
  count), as the ZeRO stage rises (but stage 3 inside ``accumulating()``), with offload.
- Recomputation never adds more than the one layer it recomputes, and nothing once a rank
  holds two layers, under 3D too.
- No more model state as tp grows, nor as a one-stage-per-rank pipeline grows (the
  partitioner's split is the exact min-max optimum, ``tessera.pipeline.partition``).
- The transient terms: zero where their docstrings say the runtime allocates nothing, no
  larger over more ranks.

Comparisons allow ``REL`` (1e-12): the same bytes summed in another order. Pure.
"""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessera.planner import PRESETS, Job, Layout, ModelShape, TPShape, check, estimate
from tessera.planner.cut import cut_of
from tessera.planner.memory import (
    DTYPE_BYTES,
    OPTIMIZER_BYTES,
    ActivationShape,
    MemoryEstimate,
    activation_bytes,
)
from tessera.planner.testing import jobs
from tessera.planner.transient import build_peak, gradient_peak, kept_grad_buffers, step_scratch

PRECISIONS = sorted(DTYPE_BYTES)
OPTIMIZERS = sorted(OPTIMIZER_BYTES)
REL = 1e-12

CLUSTER = PRESETS["a100-80g"].with_world(512)
BATCH = 48
GRIDS = [("1d", 1, 1), ("1d", 2, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]


JOBS = jobs(batch=BATCH, precisions=PRECISIONS, optimizers=OPTIMIZERS, flash_attention=st.booleans())


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """A layout at dp = 1 that `check` accepts (dp, zero and the rest set by the tests)."""
    mode, tp, depth = draw(st.sampled_from(GRIDS))
    pp = draw(st.sampled_from([1, 2]))
    return Layout(
        pp=pp,
        tp=tp,
        tp_mode=mode,
        tp_depth=depth,
        cp=draw(st.sampled_from([1, 2])),
        sequence_parallel=mode == "1d" and tp > 1 and draw(st.booleans()),
        schedule=draw(st.sampled_from(["1f1b", "gpipe", "zb-h1"])) if pp > 1 else "1f1b",
        microbatches=draw(st.sampled_from([1, 2, 4])),
        zero=draw(st.integers(0, 3)),
        offload=draw(st.booleans()),
        recompute=draw(st.booleans()),
    )


def _at(layout: Layout, job: Job, **change: object) -> float:
    layout = dataclasses.replace(layout, **change)  # type: ignore[arg-type]
    assert check(layout, job) == []
    return estimate(layout, job, CLUSTER).memory.device


@settings(max_examples=120, deadline=None)
@given(job=JOBS, layout=layouts(), dps=st.lists(st.sampled_from([1, 2, 3, 4, 6, 12]), min_size=2, max_size=2))
def test_more_data_parallel_ranks_never_hold_more(job: Job, layout: Layout, dps: list[int]) -> None:
    """The same global batch and microbatch count over more data-parallel ranks, at any ZeRO
    stage: the fullest rank's device bytes and the most model state of any rank do not grow
    (fewer rows a microbatch; at stages 1-3 a smaller shard)."""
    few, many = sorted(dps)
    assume(BATCH % (many * layout.microbatches) == 0)
    small = estimate(dataclasses.replace(layout, dp=many), job, CLUSTER)
    large = estimate(dataclasses.replace(layout, dp=few), job, CLUSTER)
    assert small.memory.device <= large.memory.device * (1 + REL)
    assert small.model_state <= large.model_state * (1 + REL)


@settings(max_examples=120, deadline=None)
@given(job=JOBS, layout=layouts(), dp=st.sampled_from([1, 2, 3, 4]))
def test_a_higher_zero_stage_never_holds_more(job: Job, layout: Layout, dp: int) -> None:
    """Stages 0 to 3 at the same layout: device bytes of the fullest rank never grow with the
    stage, except stage 3 under ``accumulating()`` (a pipeline or Megatron SP), whose shard
    sits beside the full parameters: there stages 0 to 2 still never grow."""
    layout = dataclasses.replace(layout, dp=dp)
    assume(BATCH % (dp * layout.microbatches) == 0)
    device = [_at(layout, job, zero=stage) for stage in range(4)]
    last = 3 if layout.pp > 1 or layout.sequence_parallel else 4
    assert all(b <= a * (1 + REL) for a, b in itertools.pairwise(device[:last])), device


@settings(max_examples=120, deadline=None)
@given(job=JOBS, layout=layouts(), dp=st.sampled_from([1, 2, 4]))
def test_offload_never_adds_device_bytes_and_puts_state_on_the_host(
    job: Job, layout: Layout, dp: int
) -> None:
    layout = dataclasses.replace(layout, dp=dp)
    assume(BATCH % (dp * layout.microbatches) == 0)
    on = estimate(dataclasses.replace(layout, offload=True), job, CLUSTER).memory
    off = estimate(dataclasses.replace(layout, offload=False), job, CLUSTER).memory
    assert on.device <= off.device * (1 + REL)
    assert off.host == 0.0 < on.host
    assert on.model_state - on.host < off.model_state  # fewer model-state bytes on the device


@settings(max_examples=120, deadline=None)
@given(job=JOBS, layout=layouts(), dp=st.sampled_from([1, 2, 4]))
def test_recompute_never_adds_more_than_the_layer_it_recomputes(job: Job, layout: Layout, dp: int) -> None:
    """Full recomputation keeps each layer's input instead of its activations, and holds one
    layer's full activations while it recomputes it: the fullest rank never holds more than
    without, plus that one layer; and no more at all when every rank holds two layers or
    more (the saving of two layers exceeds one layer's).

    3D is left out: there recomputation is not modelled (`test_recompute_under_3d_...`)."""
    assume(layout.tp_mode.value != "3d")
    layout = dataclasses.replace(layout, dp=dp)
    assume(BATCH % (dp * layout.microbatches) == 0)
    rows = BATCH / (dp * layout.microbatches)
    full = ActivationShape(layout.shape, layout.sequence_parallel, layout.cp, False)
    one_layer = activation_bytes(job.model, rows, job.precision, full, layers=1)[1]
    with_rc = _at(layout, job, recompute=True)
    without = _at(layout, job, recompute=False)
    assert with_rc <= (without + one_layer) * (1 + REL)
    cut = cut_of(job.model, layout.shape, layout.pp, layout.schedule, 1)
    if all(max(kind[0] for kind in rank.kinds) >= 2 for rank in cut.ranks):
        assert with_rc <= without * (1 + REL)


def test_recompute_under_3d_never_holds_more() -> None:
    job = Job(ModelShape(layers=8, hidden=64, heads=4, vocab=256, seq=32, batch=8))
    layout = Layout(tp=8, tp_mode="3d", microbatches=1)
    assert _at(layout, job, recompute=True) <= _at(layout, job, recompute=False)


@settings(max_examples=60, deadline=None)
@given(job=JOBS, mode=st.sampled_from(["1d", "2d"]), zero=st.integers(0, 3))
def test_more_tensor_parallelism_never_holds_more_model_state(job: Job, mode: str, zero: int) -> None:
    """The same job at tp = 1, 4, 16 (1D or a 2D grid): the most model state of any rank
    and the parameters of the fullest rank never grow (every split weight a smaller share)."""
    states, psis = [], []
    for tp in (1, 4, 16):
        layout = Layout(tp=tp, tp_mode=mode if tp > 1 else "1d", microbatches=1, zero=zero)
        found = estimate(layout, job, CLUSTER)
        states.append(found.model_state)
        psis.append(found.psi)
    assert states == sorted(states, reverse=True) and psis == sorted(psis, reverse=True)


@settings(max_examples=60, deadline=None)
@given(
    job=JOBS,
    name=st.sampled_from(["1f1b", "gpipe", "zb-h1"]),
    zero=st.integers(0, 1),
    tp=st.sampled_from([1, 2]),
)
def test_a_longer_pipeline_never_gives_a_rank_more_parameters(
    job: Job, name: str, zero: int, tp: int
) -> None:
    """One stage per rank: the partitioner's split is the exact min-max optimum
    (``partition_by_params``), which more stages never raise; so neither the fullest rank's
    parameters nor (stages 0-1, where the pipeline's single reduction changes nothing) the
    most model state of any rank grow with pp."""
    psis, states = [], []
    for pp in range(1, job.model.layers + 3):
        cut = cut_of(job.model, TPShape("1d", tp), pp, name, 1)
        psis.append(max(rank.psi for rank in cut.ranks))
        layout = Layout(pp=pp, tp=tp, schedule=name, microbatches=4, zero=zero)
        states.append(estimate(layout, job, CLUSTER).model_state)
    assert psis == sorted(psis, reverse=True)
    assert all(b <= a * (1 + REL) for a, b in itertools.pairwise(states)), states


# ------------------------------------------------------------------ transient terms
transient_args = {
    "psi": st.integers(1, 10**9),
    "share": st.floats(0.0, 1.0),
    "precision": st.sampled_from(PRECISIONS),
    "n": st.integers(1, 256),
    "more": st.integers(1, 256),
}


@settings(max_examples=150, deadline=None)
@given(
    **transient_args, stage=st.integers(0, 3), offload=st.booleans(), optimizer=st.sampled_from(OPTIMIZERS)
)
def test_the_step_and_backward_temporaries_shrink_with_the_shards(
    psi: int, share: float, precision: str, n: int, more: int, stage: int, offload: bool, optimizer: str
) -> None:
    """The optimizer step's temporaries and the end of the backward's gradients: none at
    stage 0 in the backward, none of Adam's or the cast's with offload (the host steps), and
    no more over more ranks once there are two (one rank gathers nothing)."""
    psi_f = max(1.0, share * psi)
    kw = {"precision": precision, "stage": stage}
    step = {"offload": offload, "optimizer": optimizer, **kw}
    for one_reduction in (False, True):
        few = gradient_peak(psi, psi_f, n=n, one_reduction=one_reduction, **kw)  # type: ignore[arg-type]
        many = gradient_peak(psi, psi_f, n=n + more, one_reduction=one_reduction, **kw)  # type: ignore[arg-type]
        if stage == 0:
            assert few == many == 0.0
        if n > 2:
            assert many <= few * (1 + REL)
    if n >= 2:
        assert step_scratch(psi_f, n=n + more, **step) <= step_scratch(psi_f, n=n, **step) * (1 + REL)  # type: ignore[arg-type]
    if offload:
        gather = DTYPE_BYTES[precision] * psi_f / (n if stage else 1) if stage in (1, 2) and n > 1 else 0.0
        assert step_scratch(psi_f, n=n, **step) == gather  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(**transient_args, flats=st.integers(1, 64), tp_share=st.floats(0, 1e9))
def test_building_holds_the_callers_model_and_zero_keeps_at_most_stage_zeros_buffers(
    psi: int, share: float, precision: str, n: int, more: int, flats: int, tp_share: float
) -> None:
    """While ``boost()`` builds, the caller's fp32 model (``4 Psi``) and at least the first
    flat's fp32 staging and the fp32 tp shards are resident; between steps stage 0 keeps
    every flat's gradient buffer, stages 1-2 at most two flats' (no more than stage 0's when
    the flats split ``psi``), stage 3 none."""
    psi_f = psi / flats
    for stage in range(4):
        built = build_peak(psi, psi_f, precision=precision, n=n, stage=stage, tp_share=tp_share)
        assert built >= 4 * psi + max(4 * psi_f, 4 * tp_share)
    kept = [kept_grad_buffers(psi, psi_f, flats, precision=precision, stage=s) for s in range(4)]
    assert kept[0] == DTYPE_BYTES[precision] * psi and kept[3] == 0.0
    assert kept[1] == kept[2] <= kept[0] * (1 + REL)


@settings(max_examples=60, deadline=None)
@given(job=JOBS, layout=layouts(), dp=st.sampled_from([1, 2, 4]))
def test_the_fullest_rank_holds_its_state_and_the_larger_of_its_activations_and_scratch(
    job: Job, layout: Layout, dp: int
) -> None:
    """`MemoryEstimate.device`: model state less what is on the host, plus the larger of the
    activations with their buffers and the late scratch; a CPU run (one memory) holds at
    least that and the host's share; every part is non-negative."""
    layout = dataclasses.replace(layout, dp=dp)
    assume(BATCH % (dp * layout.microbatches) == 0)
    mem: MemoryEstimate = estimate(layout, job, CLUSTER).memory
    parts = dataclasses.astuple(mem)
    assert all(x >= 0 for x in parts), parts
    assert mem.device == mem.model_state - mem.host + max(mem.activations + mem.buffers, mem.scratch)
    assert mem.resident >= mem.device + mem.host - REL * mem.resident
    assert mem.host <= mem.model_state
