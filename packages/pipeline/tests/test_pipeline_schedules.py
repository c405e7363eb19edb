"""Built-in schedules: check vs build, validity, bubble formulas, activation peaks, errors.

Cost conventions (the simulator's bubble is idle / makespan per rank, latency 0; the fraction
is unit-free, so only cost ratios matter):

- GPipe and 1F1B: F = 1, B = 1, W = 0, so the unsplit backward BW = B + W = 1. The bubble of
  every rank is exactly (p-1)/(m+p-1). (It stays exact for any f and BW; one test uses
  F = 1, BW = 3.)
- Interleaved 1F1B with v chunks per rank: per-chunk F = B = 1, W = 0 (equivalently 1/v each,
  a full-rank forward costing 1). Every rank's bubble is exactly (p-1)/(v*m+p-1) when
  m % p == 0 (also with F = 1, BW = 2, which one test checks).
- ZB-H1 vs 1F1B: F = B = W = 1 (so 1F1B's BW = 2). For every p in 1..8 and m in p..32 each
  rank idles exactly p-1, a third of 1F1B's 3(p-1).
- ZBV: per-chunk F = B = W = 1, compared with ZB-H1 on the same model (per-stage 2 each).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_spec,
    simulate,
    validate,
    zbv,
    zero_bubble_h1,
)

P = st.integers(1, 8)
M = st.integers(1, 32)
V = st.integers(1, 4)
UNIT_NO_W = Costs(f=1, b=1, w=0)
UNIT = Costs(f=1, b=1, w=1)
INTERLEAVED = schedule_spec("interleaved-1f1b")


def check_built(name: str, p: int, m: int, v: int | None) -> None:
    """``check`` is empty iff ``build`` succeeds; a built schedule validates and has the
    spec's placement, one compute per (microbatch, stage, pass) and no p2p inside a rank."""
    spec = SCHEDULES[name]
    lines = spec.check(p, m, v)
    if lines:
        with pytest.raises(ValueError) as err:
            spec.build(p, m, v)
        assert str(err.value) == "; ".join(lines)
        return
    sch = spec.build(p, m, v)
    validate(sch)
    assert sch.name == name
    assert sch.stage_to_rank == spec.stage_to_rank(p, v)
    assert sch.num_stages == p * spec.chunks(v) == p * sch.chunks_per_rank
    computes = sum(len(sch.compute_actions(r)) for r in range(p))
    assert computes == sch.num_microbatches * sch.num_stages * (3 if sch.split_backward else 2)
    # no p2p between stages on the same rank (e.g. the turn of the V on rank p - 1)
    for acts in sch.actions:
        for a in acts:
            assert a.is_compute or a.peer != sch.stage_to_rank[a.stage]


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(-1, 8),
    m=st.integers(-1, 32),
    v=st.none() | st.integers(-1, 4),
)
def test_check_is_empty_iff_build_succeeds(name: str, p: int, m: int, v: int | None) -> None:
    check_built(name, p, m, v)


@pytest.mark.parametrize("p", range(1, 9))
def test_every_schedule_validates_exhaustively(p: int) -> None:
    """All of p in 1..8, m in 1..32, v in 1..4: valid combinations validate, others raise."""
    for m in range(1, 33):
        for name, spec in SCHEDULES.items():
            assert spec.check(p, m, None) == spec.check(p, m, spec.default_chunks)
            for v in range(1, 5):
                check_built(name, p, m, v)


@settings(max_examples=200, deadline=None)
@given(p=P, m=M, v=st.integers(0, 4))
def test_interleaved_rule_is_megatrons(p: int, m: int, v: int) -> None:
    """The documented rule of interleaved 1F1B: v >= 1, and m % p == 0 unless v == 1."""
    assert (INTERLEAVED.check(p, m, v) == []) == (v >= 1 and (v == 1 or m % p == 0))


@settings(max_examples=100, deadline=None)
@given(p=P, m=M)
def test_gpipe_and_1f1b_bubble_is_exact(p: int, m: int) -> None:
    expected = (p - 1) / (m + p - 1)
    for sch in (gpipe(p, m), one_f_one_b(p, m)):
        result = simulate(sch, UNIT_NO_W)
        for bubble in result.bubble:
            assert math.isclose(bubble, expected, abs_tol=1e-12), (sch.name, result.bubble)
        assert math.isclose(result.mean_bubble, expected, abs_tol=1e-12)
    uneven = simulate(one_f_one_b(p, m), Costs(f=1, b=2, w=1))
    assert all(math.isclose(b, expected, abs_tol=1e-12) for b in uneven.bubble)


@settings(max_examples=100, deadline=None)
@given(p=P, m=M, v=V)
def test_interleaved_bubble_is_exact(p: int, m: int, v: int) -> None:
    if INTERLEAVED.check(p, m, v):
        with pytest.raises(ValueError, match="multiple of the pipeline ranks"):
            interleaved_1f1b(p, m, v)
        return
    result = simulate(interleaved_1f1b(p, m, v), UNIT_NO_W)
    expected = (p - 1) / (v * m + p - 1)
    assert all(math.isclose(b, expected, abs_tol=1e-12) for b in result.bubble), result.bubble
    uneven = simulate(interleaved_1f1b(p, m, v), Costs(f=1, b=2, w=0))
    assert all(math.isclose(b, expected, abs_tol=1e-12) for b in uneven.bubble)


@settings(max_examples=100, deadline=None)
@given(p=P, m=M)
def test_activation_peaks_gpipe_1f1b_zbh1(p: int, m: int) -> None:
    g, o, z = (simulate(s, UNIT) for s in (gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)))
    assert g.peak_in_flight == (m,) * p == g.peak_held
    assert o.peak_in_flight[0] == min(p, m)
    assert o.peak_in_flight == tuple(min(p - r, m) for r in range(p)) == o.peak_held
    assert z.peak_in_flight == o.peak_in_flight
    assert max(z.peak_held) <= min(p, m)


@pytest.mark.parametrize("p", range(1, 9))
def test_zbh1_bubble_is_a_third_of_1f1b(p: int) -> None:
    """Exhaustive for p in 1..8, m in p..32 with F = B = W = 1 (1F1B's BW costs 2)."""
    for m in range(p, 33):
        zb = simulate(zero_bubble_h1(p, m), UNIT)
        base = simulate(one_f_one_b(p, m), UNIT)
        assert zb.makespan == 3 * m + p - 1
        for z_idle, b_idle in zip(zb.idle, base.idle, strict=True):
            assert math.isclose(z_idle, p - 1) and math.isclose(b_idle, 3 * (p - 1))
            assert z_idle <= b_idle / 3 + 1e-9


@pytest.mark.parametrize("p", range(1, 9))
def test_zbv_memory_and_bubble(p: int) -> None:
    """ZBV (per-chunk F = B = W = 1) idles no more than ZB-H1 on the same model (per-stage
    F = B = W = 2) for m in 2p..32, is within 2 of the makespan bound 6m + p - 1, and holds
    at most 2p chunk activations (1F1B's peak on rank 0)."""
    for m in range(1, 33):
        result = simulate(zbv(p, m), UNIT)
        assert max(result.peak_held) <= 2 * p
        assert max(result.peak_in_flight) <= 2 * p
        if m >= 2 * p:
            assert 6 * m + p - 1 <= result.makespan <= 6 * m + p + 1
            zb = simulate(zero_bubble_h1(p, m), Costs(f=2, b=2, w=2))
            assert all(a <= b + 1e-9 for a, b in zip(result.idle, zb.idle, strict=True))


def test_zbv_turn_is_local() -> None:
    sch = zbv(3, 6)
    assert sch.stage_to_rank == (0, 1, 2, 2, 1, 0)
    kinds = {(a.kind, a.stage) for a in sch.actions[2]}
    assert (ActionKind.SEND_F, 2) not in kinds and (ActionKind.RECV_F, 3) not in kinds
    assert (ActionKind.SEND_F, 3) in kinds and (ActionKind.RECV_B, 3) in kinds


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: gpipe(0, 4), "p >= 1 pipeline ranks; got p=0"),
        (lambda: one_f_one_b(2, 0), "m >= 1 microbatches; got m=0"),
        (lambda: zero_bubble_h1(-1, 3), "got p=-1"),
        (lambda: zbv(2, 0), "got m=0"),
        (lambda: interleaved_1f1b(2, 4, 0), "v >= 1 chunks per rank; got v=0"),
        (lambda: interleaved_1f1b(4, 6, 2), "got m=6, p=4"),
        (lambda: build_schedule("zbv", 2, 4, 3), "zbv always places 2 chunk"),
        (lambda: build_schedule("1f1b", 2, 4, 2), "1f1b always places 1 chunk"),
        (lambda: build_schedule("pipedream", 2, 4), "unknown schedule 'pipedream'; known: "),
        (lambda: gpipe(0, 0), "p >= 1 pipeline ranks; got p=0; gpipe needs m >= 1 micro"),
    ],
)
def test_impossible_requests(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_registry_defaults() -> None:
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"} <= set(SCHEDULES)
    for name, spec in SCHEDULES.items():
        assert build_schedule(name, 2, 4).num_stages == 2 * spec.default_chunks
        assert spec.chunks() == spec.chunks(None) == spec.default_chunks
    assert interleaved_1f1b(3, 5, 1).compute_actions(0) == one_f_one_b(3, 5).compute_actions(0)


def test_1f1b_text_form() -> None:
    sch = one_f_one_b(2, 2)
    assert [str(a) for a in sch.actions[0]] == [
        "F0s0", "SEND_F0s0>r1", "F1s0", "SEND_F1s0>r1",
        "RECV_B0s0<r1", "BW0s0", "RECV_B1s0<r1", "BW1s0",
    ]
    assert str(Action(ActionKind.F, 3, 1)) == "F3s1"
    assert str(sch).splitlines()[0] == "1f1b: p=2 m=2 stages=2"
