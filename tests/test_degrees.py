"""Tier 0: one typed object for the degrees. The launcher's ``[parallel]`` section, the planner's
`Layout` and the process layout `Topology` are each a `tessera.comm.Degrees` with more, under the
same field names, and each converts to the others through it without losing a degree; the first
two are a `tessera.comm.Parallelism` (the degrees and how they run) as well."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from tessera.comm import DEGREE_NAMES, PARALLELISM_NAMES, Degrees, Parallelism, Topology, TPMode
from tessera.launcher import ParallelConfig
from tessera.planner import Layout


@st.composite
def degrees(draw: st.DrawFn) -> Degrees:
    mode = draw(st.sampled_from(TPMode))
    q = draw(st.integers(1, 3))
    depth = draw(st.integers(1, 3)) if mode is TPMode.TWO_P5_D else 1
    tp = {TPMode.ONE_D: q, TPMode.TWO_D: q * q, TPMode.TWO_P5_D: q * q * depth, TPMode.THREE_D: q**3}[mode]
    ep = draw(st.integers(1, 3))
    dp = ep * draw(st.integers(1, 3))
    return Degrees(
        dp=dp,
        pp=draw(st.integers(1, 4)),
        tp=tp,
        cp=draw(st.integers(1, 4)),
        tp_mode=mode,
        tp_depth=depth,
        ep=ep,
    )


def test_each_shape_has_exactly_the_degree_fields_under_one_name() -> None:
    names = tuple(f.name for f in dataclasses.fields(Degrees))
    assert names == DEGREE_NAMES
    for shape in (Topology, ParallelConfig, Layout):
        assert issubclass(shape, Degrees), shape
        fields = {f.name for f in dataclasses.fields(shape)}
        assert set(names) <= fields, (shape, set(names) - fields)
        assert not {"sp", "depth", "sp_mode", "sp_layout"} & fields, (shape, fields)


@given(degrees())
def test_the_degrees_round_trip_through_every_shape(d: Degrees) -> None:
    config = ParallelConfig(**d.degree_values())
    layout = Layout(**d.degree_values())
    topology = config.topology()
    for shape in (config, layout, topology):
        assert shape.degrees() == d, (type(shape).__name__, shape.degrees(), d)
        assert shape.world_size == d.dp * d.pp * d.tp * d.cp
    assert Topology(**layout.degree_values()) == topology


@given(
    degrees(),
    st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zb-h1"]),
    st.integers(1, 8),
    st.booleans(),
    st.sampled_from(["ring", "ulysses"]),
)
def test_how_the_degrees_run_has_one_home_too(
    d: Degrees, schedule: str, microbatches: int, sp: bool, cp_mode: str
) -> None:
    """The schedule, microbatches, context mode and the rest are `Parallelism`'s fields, which the
    launcher's ``[parallel]`` and the planner's `Layout` both are: each converts to the other
    through ``parallelism_values`` without losing one."""
    for shape in (ParallelConfig, Layout):
        assert issubclass(shape, Parallelism)
        own = {f.name for f in dataclasses.fields(shape)} - set(PARALLELISM_NAMES)
        assert own == ({"auto", "cluster"} if shape is ParallelConfig else {"zero", "offload", "recompute"})
    config = ParallelConfig(
        **d.degree_values(),
        schedule=schedule,
        microbatches=microbatches,
        sequence_parallel=sp,
        cp_mode=cp_mode,
    )
    layout = Layout(**config.parallelism_values())
    assert ParallelConfig(**layout.parallelism_values()) == config
    assert layout.parallelism_values() == config.parallelism_values()
