"""Tier 0: topology invariants over random degrees up to 4096 ranks."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessera.comm import Axis, Topology, TPMode


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    mode = draw(st.sampled_from(list(TPMode)))
    depth = 1
    if mode is TPMode.ONE_D:
        tp = draw(st.integers(1, 16))
    elif mode is TPMode.TWO_D:
        tp = draw(st.integers(1, 4)) ** 2
    elif mode is TPMode.TWO_P5_D:
        depth = draw(st.integers(1, 4))
        tp = draw(st.integers(1, 3)) ** 2 * depth
    else:
        tp = draw(st.integers(1, 3)) ** 3
    budget = 4096 // tp
    dp = draw(st.integers(1, max(1, min(16, budget))))
    pp = draw(st.integers(1, max(1, min(8, budget // dp))))
    cp = draw(st.integers(1, max(1, min(4, budget // (dp * pp)))))
    return Topology(dp=dp, pp=pp, tp=tp, cp=cp, tp_mode=mode, tp_depth=depth)


@settings(max_examples=150)
@given(topologies())
def test_groups_partition_the_world(t: Topology) -> None:
    assert t.world_size <= 4096
    for axis in t.axes:
        groups = t.groups(axis)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(t.world_size)), axis
        assert all(len(g) == t.size(axis) for g in groups), axis
        assert len(groups) * t.size(axis) == t.world_size


@settings(max_examples=150)
@given(topologies(), st.data())
def test_coordinates_round_trip(t: Topology, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, t.world_size - 1))
    coords = t.coordinates(rank)
    main = {a: coords[Axis(a)] for a in ("pp", "dp", "cp", "tp")}
    assert t.rank(main) == rank
    for axis in t.axes:
        group = t.group_of(rank, axis)
        assert rank in group
        assert group.index(rank) == coords[axis]
        assert group in t.groups(axis)


@settings(max_examples=100)
@given(topologies())
def test_sub_axes_tile_the_tp_group(t: Topology) -> None:
    subs = [a for a in t.axes if a.value.startswith("tp_")]
    assume(subs)  # 1d has no sub-axes: nothing to check
    for rank in range(0, t.world_size, max(1, t.world_size // 7)):
        tp_group = set(t.group_of(rank, "tp"))
        for axis in subs:
            assert set(t.group_of(rank, axis)) <= tp_group
        # the sub-axes together span the tp group
        assert t.size(subs) == t.tp
        assert set(t.group_of(rank, subs)) == tp_group


def test_layout_is_tp_fastest() -> None:
    t = Topology(pp=2, dp=2, tp=2)
    assert t.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert t.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert t.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.groups(["dp", "tp"]) == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_2d_rows_and_columns() -> None:
    t = Topology(tp=4, tp_mode="2d")
    assert t.groups("tp_row") == ((0, 1), (2, 3))
    assert t.groups("tp_col") == ((0, 2), (1, 3))
    # as in Colossal-AI: index in the row group is the column j, in the column group the row i
    assert t.coordinates(2)[Axis.TP_ROW] == 0 and t.coordinates(2)[Axis.TP_COL] == 1


def test_2p5d_and_3d_axes() -> None:
    t = Topology(tp=8, tp_mode="2.5d", tp_depth=2)
    assert t.groups("tp_dep") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.groups("tp_row")[0] == (0, 1)
    c = Topology(tp=8, tp_mode="3d")
    assert c.groups("tp_input")[0] == (0, 1)
    assert c.groups("tp_weight")[0] == (0, 2)
    assert c.groups("tp_output")[0] == (0, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 6, "tp_mode": "2d"}, "tp=6 is not"),
        ({"tp": 9, "tp_mode": "3d"}, "tp=9 is not"),
        (
            {"tp": 12, "tp_mode": "2.5d", "tp_depth": 2},
            "tp=12 is not q*q*depth: tp/depth = 6 is not a square",
        ),
        ({"tp": 8, "tp_mode": "2.5d", "tp_depth": 3}, "tp=8 is not q*q*depth: depth=3 does not divide it"),
        ({"tp": 4, "tp_depth": 2}, "depth=2"),
        ({"dp": 0}, "dp must be a positive integer, got 0"),
        ({"tp_mode": "4d"}, "'4d'"),
    ],
)
def test_impossible_topologies_name_the_numbers(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_world_size_check_and_bad_axes() -> None:
    t = Topology(dp=2, tp=2)
    t.check_world_size(4)
    with pytest.raises(ValueError, match="world size 6 != pp\\*dp\\*cp\\*tp = 1\\*2\\*1\\*2 = 4"):
        t.check_world_size(6)
    with pytest.raises(ValueError, match="tp_row"):
        t.groups("tp_row")
    with pytest.raises(ValueError, match="rank 4 is outside"):
        t.coordinates(4)


@st.composite
def expert_topologies(draw: st.DrawFn) -> Topology:
    ep = draw(st.integers(2, 8))
    dp = ep * draw(st.integers(1, 4))
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 3))
    cp = draw(st.integers(1, 2))
    return Topology(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)


@settings(max_examples=150)
@given(expert_topologies(), st.data())
def test_expert_groups_subdivide_the_data_parallel_group(t: Topology, data: st.DataObject) -> None:
    assert Axis.EP in t.axes and Axis.EDP in t.axes
    assert t.size("ep") == t.ep and t.size("edp") == t.dp // t.ep
    rank = data.draw(st.integers(0, t.world_size - 1))
    dp_group = t.group_of(rank, "dp")
    ep_group, edp_group = t.group_of(rank, "ep"), t.group_of(rank, "edp")
    # the ep group: the ep consecutive dp coordinates of this rank's block, in dp order
    block = t.coordinate(rank, "dp") // t.ep
    assert ep_group == dp_group[block * t.ep : (block + 1) * t.ep], (ep_group, dp_group)
    # the edp group: the ranks at the same place of every block (the same experts)
    where = t.coordinate(rank, "ep")
    assert edp_group == dp_group[where :: t.ep], (edp_group, dp_group)
    assert t.coordinate(rank, "ep") == t.coordinate(rank, "dp") % t.ep
    assert t.coordinate(rank, "edp") == t.coordinate(rank, "dp") // t.ep
    # one rank in common, and together they span the dp group
    assert set(ep_group) & set(edp_group) == {rank}
    assert set(t.group_of(rank, ["ep", "edp"])) == set(dp_group)
    # the other coordinates stay fixed along both
    for peer in (*ep_group, *edp_group):
        for axis in ("pp", "cp", "tp"):
            assert t.coordinate(peer, axis) == t.coordinate(rank, axis), (peer, axis)


def test_expert_groups_by_hand() -> None:
    t = Topology(dp=4, tp=2, ep=2)
    assert t.groups("dp") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert t.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert t.groups("edp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.describe() == "pp=1 dp=4 ep=2 cp=1 tp=2 (1d)"


def test_expert_degree_is_validated() -> None:
    with pytest.raises(ValueError, match=r"ep \(3\) must divide dp \(4\)"):
        Topology(dp=4, ep=3)
    with pytest.raises(ValueError, match="ep must be a positive integer, got 0"):
        Topology(dp=4, ep=0)
    with pytest.raises(ValueError, match=r"'ep' exists only with expert parallelism \(ep > 1\)"):
        Topology(dp=4).groups("ep")
    assert Axis.EP not in Topology(dp=4).axes
