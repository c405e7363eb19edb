"""Tier 0: the planner's mixture-of-experts formulas written out by hand: expert memory per
rank under expert parallelism and ZeRO, the kept assignments under a capacity, the
all-to-all bytes and seconds of a step, `estimate` of a job with experts against the dense
one, and the search over ep. Exact (the
same float operations, or integers), or rel 1e-9 where a difference of sums is taken."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.planner import PRESETS, Job, Layout, ModelShape, check, estimate, search
from tessera.planner.experts import (
    A2A_PER_LAYER,
    ExpertShape,
    all_to_all_bytes,
    all_to_all_seconds,
    expert_memory,
    kept_assignments,
)
from tessera.planner.links import Link
from tessera.planner.memory import model_state_bytes

MOE = ExpertShape(layers=3, experts=8, top_k=2, hidden=48, shared_hidden=16)
D = 32


def test_parameters_of_an_expert_and_of_the_dense_part() -> None:
    assert MOE.expert_params(D) == 3 * D * 48  # SwiGLU: w1, w3 [d, h], w2 [h, d]
    assert ExpertShape(layers=1, experts=4, top_k=1, hidden=10, swiglu=False).expert_params(D) == 2 * D * 10
    assert MOE.dense_params(D) == 8 * D + 3 * D * 16  # router [E, d] and the shared SwiGLU expert


def test_fp32_adamw_expert_memory_by_hand() -> None:
    # stage 1 at dp=4, ep=2: 4 of the 8 experts per layer; params and grads whole (4 + 4 bytes),
    # Adam's two moments (8 bytes) over the dp / ep = 2 ranks holding the same experts, + 4
    # bytes of step counter per flat
    got = expert_memory(MOE, D, ep=2, dp=4, stage=1)
    psi = 3 * 4 * MOE.expert_params(D)
    assert got.psi == psi
    assert got.experts == 4 * psi + 4 * psi + 8 * psi / 2 + 4
    dense = 3 * MOE.dense_params(D)
    assert got.dense == 4 * dense + 4 * dense + 8 * dense / 4 + 4
    assert got.total == got.experts + got.dense


@given(
    ep=st.sampled_from([1, 2, 4, 8]),
    edp=st.sampled_from([1, 2, 3]),
    stage=st.integers(0, 3),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_experts_divide_by_ep_and_their_state_by_the_expert_data_group(
    ep: int, edp: int, stage: int, precision: str
) -> None:
    dp = ep * edp
    got = expert_memory(MOE, D, ep=ep, dp=dp, stage=stage, precision=precision)
    psi = MOE.layers * MOE.experts // ep * MOE.expert_params(D)
    p, g, s, host = model_state_bytes(psi, stage=stage, n=edp, precision=precision, offload=False)
    assert got.psi == psi and got.experts == p + g + s - host
    if ep == 1:  # plain data parallelism: the experts shard over every dp rank like the rest
        whole = expert_memory(MOE, D, ep=1, dp=dp, stage=stage, precision=precision)
        assert got.experts == whole.experts
    more = expert_memory(MOE, D, ep=ep, dp=2 * dp, stage=stage, precision=precision)
    assert more.experts <= got.experts  # a larger expert-data group never holds more


def test_bad_ep_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="ep=3 must divide dp=4 and the experts"):
        expert_memory(MOE, D, ep=3, dp=4, stage=0)
    with pytest.raises(ValueError, match=r"top_k \(5\) must be between 1 and experts \(4\)"):
        ExpertShape(layers=1, experts=4, top_k=5, hidden=8)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        ExpertShape(layers=1, experts=4, top_k=1, hidden=8, capacity_factor=0.0)


@given(tokens=st.integers(0, 500), factor=st.sampled_from([None, 0.25, 1.0, 1.25, 4.0]))
def test_kept_assignments_are_capped_by_the_experts_capacity(tokens: int, factor: float | None) -> None:
    moe = ExpertShape(layers=1, experts=8, top_k=2, hidden=4, capacity_factor=factor)
    got = kept_assignments(moe, tokens)
    if factor is None:
        assert got == 2 * tokens
    else:
        assert got == min(2 * tokens, 8 * math.ceil(factor * 2 * tokens / 8))


def test_all_to_all_bytes_and_seconds_by_hand() -> None:
    tokens, ep = 256, 4
    assert all_to_all_bytes(MOE, tokens, D, ep=1) == 0.0
    rows = tokens * 2 * 3 / 4  # 3/4 of the 512 assignments go to the other three ranks
    assert all_to_all_bytes(MOE, tokens, D, ep=ep) == rows * D * 4 + 8 * (8 - 2)
    assert all_to_all_bytes(MOE, tokens, D, ep=ep, precision="bf16") == rows * D * 2 + 8 * 6
    link = Link(latency=1e-5, bandwidth=1e9)
    buffer = tokens * 2 * D * 4  # every assignment's row, of which (ep - 1) / ep leaves
    one = 3 * 1e-5 + 3 / 4 * buffer / 1e9
    counts = 3 * 1e-5 + 3 / 4 * 64 / 1e9
    want = MOE.layers * 2 * (A2A_PER_LAYER * one + counts)
    assert all_to_all_seconds(MOE, tokens, D, ep=ep, microbatches=2, link=link) == pytest.approx(
        want, rel=1e-12
    )
    assert all_to_all_seconds(MOE, tokens, D, ep=1, microbatches=2, link=link) == 0.0


JOB = Job(
    ModelShape(layers=4, hidden=D, heads=4, vocab=64, seq=16, batch=16), precision="fp32", optimizer="adamw"
)


def _with(moe: ExpertShape) -> Job:
    return dataclasses.replace(JOB, moe=moe)


def test_experts_add_the_all_to_alls_to_the_dense_step() -> None:
    cluster = PRESETS["a100-80g"].with_world(8)
    layout = Layout(dp=4, microbatches=2, zero=1)
    dense = estimate(layout, JOB, cluster)
    moe = ExpertShape(layers=2, experts=8, top_k=2, hidden=64)
    tokens = 16 // (4 * 2) * 16
    for ep in (1, 2, 4):
        got = estimate(dataclasses.replace(layout, ep=ep), _with(moe), cluster)
        a2a = all_to_all_seconds(
            moe, tokens, D, ep=ep, microbatches=2, link=Link(*cluster.link(ep, cluster.ranks_per_node(4)))
        )
        assert got.time.total - dense.time.total == pytest.approx(a2a, rel=1e-9, abs=1e-15)
        assert (a2a > 0) == (ep > 1)


def test_experts_state_is_divided_by_ep() -> None:
    """Stage 0, fp32 AdamW: 16 bytes per element (parameter, gradient, two moments); going
    from ep=1 to ep=4 drops three quarters of every layer's experts from each rank."""
    cluster = PRESETS["a100-80g"].with_world(4)
    layout = Layout(dp=4, microbatches=1, zero=0)
    moe = ExpertShape(layers=3, experts=8, top_k=2, hidden=64)
    one, four = (estimate(dataclasses.replace(layout, ep=ep), _with(moe), cluster) for ep in (1, 4))
    dropped = 3 * 6 * moe.expert_params(D)
    assert one.memory.model_state - four.memory.model_state == 16 * dropped
    assert one.psi - four.psi == dropped
    dense = estimate(layout, JOB, cluster)
    mlp = 3 * (2 * D * JOB.model.ffn + JOB.model.ffn + D)
    added = 3 * (8 * moe.expert_params(D) + moe.dense_params(D))
    # + 4: the step counter of one more flat buffer (the experts'), as model_state_bytes counts it
    assert one.memory.model_state - dense.memory.model_state == 16 * (added - mlp) + 4
    assert one.model_state - dense.model_state == 16 * (added - mlp) + 4


def test_under_tp_the_rank_holds_its_share_of_the_mlps_and_of_every_expert() -> None:
    cluster = PRESETS["a100-80g"].with_world(4)
    layout = Layout(dp=2, tp=2, microbatches=1, zero=0)
    moe = ExpertShape(layers=2, experts=4, top_k=2, hidden=64)
    got = estimate(dataclasses.replace(layout, ep=2), _with(moe), cluster)
    dense = estimate(layout, JOB, cluster)
    f = JOB.model.ffn
    mlp = 2 * ((2 * D * f + f) // 2 + D)  # fc_in and fc_out's weight split two ways, fc_out's bias whole
    # 2 of 4 experts, half of each one's hidden units on each tp rank; the router whole
    added = 2 * (2 * (3 * D * 32) + 4 * D)
    assert added == 2 * (2 * moe.expert_params(D, 2) + moe.dense_params(D, 2))
    assert got.memory.model_state - dense.memory.model_state == 16 * (added - mlp) + 4


def test_check_refuses_what_it_does_not_model_of_experts() -> None:
    moe = ExpertShape(layers=3, experts=8, top_k=2, hidden=64)
    assert "layout.ep=2 but the job has no experts (job.moe)" in check(
        Layout(dp=2, ep=2, microbatches=1), JOB
    )
    lines = check(Layout(dp=4, ep=3, microbatches=1), _with(moe))
    assert "layout.ep=3 must divide dp=4 and the experts (8)" in lines
    assert check(Layout(dp=2, tp=2, microbatches=1), _with(moe)) == []  # 1D tp: the experts split
    assert check(Layout(dp=1, tp=2, sequence_parallel=True, microbatches=1), _with(moe)) == []  # as the MLP
    lines = check(Layout(dp=1, tp=4, tp_mode="2d", microbatches=1), _with(moe))
    assert "job.moe: experts are modelled under 1D tp, got tp=4 2d" in lines[0], lines
    lines = check(Layout(dp=1, pp=2, microbatches=2), _with(moe))
    assert "job.moe: experts are modelled at pp = cp = 1, got pp=2 cp=1" in lines
    deep = ExpertShape(layers=9, experts=8, top_k=2, hidden=64)
    assert "job.moe.layers=9 is more than the model's 4 layers" in check(Layout(microbatches=1), _with(deep))
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        estimate(Layout(dp=4, ep=3, microbatches=1), _with(moe), PRESETS["a100-80g"].with_world(4))


def test_the_search_tries_every_ep_and_predicts_each_as_estimate_does() -> None:
    cluster = PRESETS["a100-80g"].with_world(4)
    job = _with(ExpertShape(layers=4, experts=8, top_k=2, hidden=64))
    result = search(job, cluster, world=4, keep=200)
    assert result.ranked and {c.layout.ep for c in result.ranked} == {1, 2, 4}
    assert {1, 2} <= {c.layout.tp for c in result.ranked}  # 1D tp splits the experts
    for cand in result.ranked:
        assert (cand.layout.pp, cand.layout.cp) == (1, 1)  # Megatron SP is modelled, as for the MLP
        assert cand.estimate == estimate(cand.layout, job, cluster)
    assert "dp4/ep2" in next(c.label() for c in result.ranked if c.layout.ep == 2)
