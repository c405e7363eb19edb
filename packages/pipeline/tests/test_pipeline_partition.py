"""Partitioner: exact min-max contiguous split (vs brute force), placements, layouts, errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.pipeline import (
    SCHEDULES,
    Balance,
    Layout,
    Partition,
    partition_by_cost,
    partition_by_params,
    partition_by_profile,
    stage_to_rank,
)
from tessera.pipeline.layout import rank_of_stage


def brute_force(costs: list[float], k: int) -> float:
    """The smallest largest-stage sum over every split of ``costs`` into ``k`` parts."""
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(math.fsum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = min(best, worst)
    return best


@st.composite
def costs_and_grid(draw: st.DrawFn, integers: bool) -> tuple[list[float], int, int]:
    n = draw(st.integers(1, 9))
    elem = (
        st.integers(0, 20).map(float)
        if integers
        else st.floats(0, 100, allow_nan=False, allow_infinity=False)
    )
    costs = draw(st.lists(elem, min_size=n, max_size=n))
    p = draw(st.integers(1, n))
    v = draw(st.integers(1, n // p))
    return costs, p, v


def check_partition(part: Partition, costs: list[float], stages: int) -> None:
    assert part.num_stages == stages
    assert part.ranges[0][0] == 0 and part.ranges[-1][1] == len(costs)
    for (_, stop), (start, _) in itertools.pairwise(part.ranges):
        assert stop == start
    for s, (a, b) in enumerate(part.ranges):
        assert b > a
        assert math.isclose(part.costs[s], math.fsum(costs[a:b]), abs_tol=1e-9)
        for block in range(a, b):
            assert part.stage_of_block(block) == s


@settings(max_examples=300, deadline=None)
@given(costs_and_grid(integers=True))
def test_partition_is_optimal_integer_costs(case: tuple[list[float], int, int]) -> None:
    costs, p, v = case
    part = partition_by_cost(costs, stage_to_rank(Layout.LOOP, p, v), balance_ranks=False)
    check_partition(part, costs, p * v)
    assert part.max_cost == brute_force(costs, p * v)


@settings(max_examples=200, deadline=None)
@given(costs_and_grid(integers=False))
def test_partition_is_optimal_float_costs(case: tuple[list[float], int, int]) -> None:
    costs, p, v = case
    part = partition_by_profile(costs, stage_to_rank(Layout.V, p, v), balance_ranks=False)
    check_partition(part, costs, p * v)
    assert math.isclose(part.max_cost, brute_force(costs, p * v), rel_tol=1e-9, abs_tol=1e-9)
    assert part.balance is Balance.PROFILE


def test_uniform_blocks_split_evenly() -> None:
    part = partition_by_cost([1.0] * 12, range(4))
    assert part.ranges == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert part.costs == (3.0, 3.0, 3.0, 3.0)
    assert part.rank_costs == (3.0, 3.0, 3.0, 3.0)


def test_heavy_block_gets_its_own_stage() -> None:
    part = partition_by_cost([1, 1, 10, 1, 1, 1], range(3))
    assert part.max_cost == 10
    assert part.blocks_of_stage(part.stage_of_block(2)) == range(2, 3)


def test_params_from_modules_and_ints() -> None:
    blocks = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8), nn.Linear(8, 2)]
    counts = [20, 0, 40, 18]
    from_modules = partition_by_params(blocks, range(3))
    from_ints = partition_by_params(counts, range(3))
    assert from_modules.block_costs == tuple(float(c) for c in counts)
    assert from_modules.ranges == from_ints.ranges
    assert from_modules.max_cost == 40 and from_modules.balance is Balance.PARAMS
    assert from_modules.stage_of_block(2) == 1
    with pytest.raises(ValueError, match="block 1 is a bool"):
        partition_by_params([3, True], [0])


def test_interleaved_layout() -> None:
    part = partition_by_cost([1.0] * 8, SCHEDULES["interleaved-1f1b"].stage_to_rank(2, 2))
    assert part.stage_to_rank == (0, 1, 0, 1)
    assert part.stages_of_rank(1) == (1, 3)
    assert [part.rank_of_block(b) for b in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_v_layout() -> None:
    assert stage_to_rank(Layout.V, 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_to_rank(Layout.V, 2, 3) == (0, 1, 1, 0, 0, 1)
    assert stage_to_rank(Layout.LOOP, 3, 2) == (0, 1, 2, 0, 1, 2)
    for p in range(1, 6):
        for r in range(p):
            assert rank_of_stage(Layout.V, r, p, 2) == r
            assert rank_of_stage(Layout.V, 2 * p - 1 - r, p, 2) == r
    part = partition_by_cost([1.0] * 4, stage_to_rank(Layout.V, 2, 2))
    assert part.stage_to_rank == (0, 1, 1, 0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_partition_takes_a_schedules_placement(name: str) -> None:
    spec = SCHEDULES[name]
    schedule = spec.build(3, 6)
    blocks = [5] * (2 * schedule.num_stages)
    part = partition_by_params(blocks, schedule=schedule)
    assert part.stage_to_rank == schedule.stage_to_rank == spec.stage_to_rank(3)
    assert partition_by_cost(blocks, spec.stage_to_rank(3)).ranges == part.ranges
    assert part.num_ranks == 3 and part.num_stages == 3 * spec.chunks()
    assert all(len(part.stages_of_rank(r)) == spec.chunks() for r in range(3))


@pytest.mark.parametrize(
    ("costs", "placement", "match"),
    [
        ([1.0, 1.0, 1.0], (0, 1, 0, 1), "cannot split 3 blocks into 4 stages"),
        ([1.0, 1.0], (), "at least one stage; got none"),
        ([1.0, 1.0], (0, 2), r"ranks without a stage: \[1\]"),
        ([1.0, 1.0], (-1, 0), r"placement \(-1, 0\) must put every stage on a rank >= 0"),
        ([1.0, -2.0], (0,), "block 1 has cost -2.0"),
        ([1.0, math.nan], (0,), "block 1 has cost nan"),
        ([], (0,), "cannot split 0 blocks into 1 stages"),
    ],
)
def test_partition_errors(costs: list[float], placement: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition_by_cost(costs, placement)


def test_partition_rejects_bad_ranges_and_stages() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        Partition(((0, 2), (3, 4)), (2.0, 1.0), (1.0,) * 4, (0, 1))
    with pytest.raises(ValueError, match="2 ranges for 3 placed stages"):
        Partition(((0, 2), (2, 4)), (2.0, 2.0), (1.0,) * 4, (0, 1, 0))
    with pytest.raises(ValueError, match=r"stage 9 is outside 0\.\.3"):
        rank_of_stage(Layout.LOOP, 9, 2, 2)
    with pytest.raises(ValueError, match="num_ranks must be >= 1; got 0"):
        stage_to_rank(Layout.LOOP, 0, 1)
    with pytest.raises(ValueError, match="chunks_per_rank must be >= 1; got 0"):
        stage_to_rank(Layout.V, 1, 0)
    with pytest.raises(TypeError, match=r"rank of every stage .* got the int 2"):
        partition_by_cost([1.0, 1.0], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exactly one of placement .* and schedule"):
        partition_by_cost([1.0, 1.0])
    with pytest.raises(ValueError, match=r"got placement=range\(0, 2\), schedule='gpipe'"):
        partition_by_cost([1.0, 1.0], range(2), schedule=SCHEDULES["gpipe"].build(2, 1))
    with pytest.raises(ValueError, match=r"block 7 is outside 0\.\.3"):
        partition_by_cost([1.0] * 4, range(2)).stage_of_block(7)


def _rank_and_stage_max(part: Partition) -> tuple[float, float]:
    return max(part.rank_costs), part.max_cost


@settings(max_examples=300, deadline=None)
@given(costs_and_grid(integers=True), st.sampled_from([Layout.V, Layout.LOOP]))
def test_balance_ranks_never_worse(case: tuple[list[float], int, int], layout: Layout) -> None:
    """``balance_ranks`` keeps a valid contiguous split and never raises the largest rank
    cost (nor, at an equal one, the largest stage cost) of the stage-balanced split."""
    costs, p, v = case
    if layout is Layout.V and v != 2:
        v = 1
    placement = stage_to_rank(layout, p, v)
    if len(placement) > len(costs):
        return
    plain = partition_by_cost(costs, placement, balance_ranks=False)
    ranked = partition_by_cost(costs, placement)
    check_partition(ranked, costs, len(placement))
    assert _rank_and_stage_max(ranked) <= _rank_and_stage_max(plain)
    if len(set(placement)) == len(placement):  # one stage per rank: nothing to even out
        assert ranked.ranges == plain.ranges


def test_balance_ranks_evens_out_the_v() -> None:
    """[embed, 6 layers, head] in the V on p = 2: stage balancing gives the middle rank four
    layers; rank balancing gives each rank three (the ends take the embedding and head)."""
    counts = [74, *([197] * 6), 66]
    placement = stage_to_rank(Layout.V, 2, 2)
    plain = partition_by_params(counts, placement, balance_ranks=False)
    ranked = partition_by_params(counts, placement)
    assert plain.rank_costs == (74 + 197 + 197 + 66, 4 * 197)
    assert ranked.rank_costs == (74 + 3 * 197 + 66, 3 * 197)
    assert ranked.ranges == ((0, 3), (3, 4), (4, 6), (6, 8))
