"""Tier 0: ``integer_root`` and ``TPGrid``, the one place a tp degree becomes a grid; property
tests over the degrees, and agreement with the group sizes ``Topology`` lists."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.comm import Axis, Topology, TPGrid, TPMode, integer_root

sides = st.integers(min_value=1, max_value=40)
depths = st.integers(min_value=1, max_value=8)
degrees = st.integers(min_value=1, max_value=5000)


@given(r=st.integers(min_value=1, max_value=10**6), k=st.integers(min_value=1, max_value=5))
def test_integer_root_finds_every_exact_power(r: int, k: int) -> None:
    assert integer_root(r**k, k) == r


@given(n=st.integers(min_value=-10, max_value=10**7), k=st.integers(min_value=1, max_value=4))
def test_integer_root_is_none_exactly_off_the_powers(n: int, k: int) -> None:
    r = integer_root(n, k)
    if r is None:
        assert all(c**k != n for c in range(1, int(max(n, 1) ** (1 / k)) + 3))
    else:
        assert r >= 1 and r**k == n


def test_integer_root_refuses_a_power_below_one() -> None:
    with pytest.raises(ValueError, match="k=0"):
        integer_root(4, 0)


def _valid(mode: TPMode, q: int, depth: int) -> TPGrid:
    tp = {TPMode.ONE_D: q, TPMode.TWO_D: q * q, TPMode.TWO_P5_D: q * q * depth, TPMode.THREE_D: q**3}[mode]
    return TPGrid.of(mode.value, tp, depth if mode is TPMode.TWO_P5_D else 1)


@given(mode=st.sampled_from(TPMode), q=sides, depth=depths)
def test_valid_grids_round_trip(mode: TPMode, q: int, depth: int) -> None:
    grid = _valid(mode, q, depth)
    assert grid.mode is mode and grid.side == q
    assert grid == TPGrid(mode, grid.tp, grid.depth) == TPGrid.of(grid.mode, grid.tp, grid.depth)
    # the side rebuilds the degree, the splits follow it
    rebuilt = {
        TPMode.ONE_D: grid.side,
        TPMode.TWO_D: grid.side**2,
        TPMode.TWO_P5_D: grid.side**2 * grid.depth,
        TPMode.THREE_D: grid.side**3,
    }[mode]
    assert rebuilt == grid.tp
    assert grid.width_split == (grid.tp if mode is TPMode.ONE_D else q)
    expected_blocks = {
        TPMode.ONE_D: 1,
        TPMode.TWO_D: q,
        TPMode.TWO_P5_D: q * depth,
        TPMode.THREE_D: q * q,
    }[mode]
    assert grid.row_blocks == expected_blocks


@given(mode=st.sampled_from(TPMode), tp=degrees, depth=depths)
def test_a_degree_is_a_grid_exactly_when_it_has_the_modes_shape(mode: TPMode, tp: int, depth: int) -> None:
    depth = depth if mode is TPMode.TWO_P5_D else 1
    shaped = {
        TPMode.ONE_D: True,
        TPMode.TWO_D: any(q * q == tp for q in range(1, 80)),
        TPMode.TWO_P5_D: any(q * q * depth == tp for q in range(1, 80)),
        TPMode.THREE_D: any(q**3 == tp for q in range(1, 20)),
    }[mode]
    if shaped:
        assert TPGrid.of(mode, tp, depth).tp == tp
    else:
        with pytest.raises(
            ValueError, match=rf"tp={tp} is not .*tp_mode {re.escape(mode.value)}.*depth={depth}"
        ):
            TPGrid.of(mode, tp, depth)


@given(mode=st.sampled_from([TPMode.ONE_D, TPMode.TWO_D, TPMode.THREE_D]), depth=st.integers(2, 8))
def test_a_depth_outside_2p5d_is_refused_naming_it(mode: TPMode, depth: int) -> None:
    with pytest.raises(
        ValueError, match=rf"where it is: depth={depth} .*tp_mode {re.escape(mode.value)}, tp=8"
    ):
        TPGrid.of(mode, 8, depth, where="where it is")


@pytest.mark.parametrize(
    ("mode", "tp", "depth", "message"),
    [
        ("4d", 4, 1, "got '4d' (tp=4, depth=1)"),
        ("2d", 0, 1, "tp=0, depth=1 (tp_mode 2d)"),
        ("2.5d", 8, 0, "tp=8, depth=0 (tp_mode 2.5d)"),
        ("2.5d", 8, 3, "tp=8 is not q*q*depth: depth=3 does not divide it (tp_mode 2.5d, tp=8, depth=3)"),
        ("2.5d", 12, 2, "tp=12 is not q*q*depth: tp/depth = 6 is not a square"),
    ],
)
def test_impossible_grids_name_the_numbers(mode: str, tp: int, depth: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^at L3: .*{re.escape(message)}"):
        TPGrid.of(mode, tp, depth, where="at L3")


@given(mode=st.sampled_from(TPMode), q=st.integers(1, 4), depth=st.integers(1, 3))
def test_the_grid_agrees_with_the_topology_groups(mode: TPMode, q: int, depth: int) -> None:
    grid = _valid(mode, q, depth)
    topo = Topology(tp=grid.tp, tp_mode=mode, tp_depth=grid.depth)
    assert topo.grid == grid
    line = grid.line_axis()
    assert line in topo.axes
    # a line holds the ranks a layer's hidden is split over: width_split of them
    assert topo.size(line) == grid.width_split
    # a microbatch's rows split over the tp ranks that are not on one line
    assert topo.size(Axis.TP) // topo.size(line) == grid.row_blocks
