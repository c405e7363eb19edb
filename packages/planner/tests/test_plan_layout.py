"""Tier 0: a `Layout` is the comm package's `Degrees` with the planner's settings, and `check`
names every thing it cannot model in a line of its own. Faults are injected one at a time and
in any combination into a layout that is valid, and each must come back as exactly one line
naming its values (no more lines than faults). Pure (no processes, no torch)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import Degrees, TPMode
from tessera.comm.degrees import DEGREE_NAMES
from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.comm.sequence_modes import Mode as ContextMode
from tessera.pipeline import SCHEDULES, schedule_spec
from tessera.planner import Job, Layout, ModelShape, check
from tessera.planner.experts import ExpertShape
from tessera.planner.memory import DTYPE_BYTES, OPTIMIZER_BYTES

MODEL = ModelShape(layers=8, hidden=64, heads=8, vocab=128, seq=32, batch=96)

# (mode, tp, depth): grids of tessera.comm.TPGrid
GRIDS = [("1d", 1, 1), ("1d", 2, 1), ("1d", 3, 1), ("1d", 4, 1), ("2d", 4, 1), ("2d", 9, 1)]
GRIDS += [("2.5d", 8, 2), ("2.5d", 4, 1), ("2.5d", 12, 3), ("3d", 8, 1)]


@st.composite
def valid_layouts(draw: st.DrawFn) -> tuple[Layout, Job]:
    """A layout `check` must accept and its job: a grid of its mode, a schedule with chunks
    and microbatches its spec's rules accept, a batch dp * microbatches divides."""
    mode, tp, depth = draw(st.sampled_from(GRIDS))
    pp = draw(st.integers(1, 4))
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    spec = schedule_spec(name)
    v = spec.default_chunks if spec.fixed_chunks else draw(st.integers(spec.min_chunks or 1, 3))
    m = draw(st.integers(1, 4))
    if spec.check(pp, m, v):  # the one rule registered (Megatron's): m a multiple of pp
        m = pp * draw(st.integers(1, 2))
    assert spec.check(pp, m, v) == []
    dp = draw(st.integers(1, 4))
    layout = Layout(
        dp=dp,
        pp=pp,
        tp=tp,
        cp=draw(st.integers(1, 3)),
        tp_mode=mode,
        tp_depth=depth,
        cp_mode=draw(st.sampled_from(list(ContextMode))),
        cp_layout=draw(st.sampled_from(list(ContextLayout))),
        sequence_parallel=draw(st.booleans()),
        schedule=name,
        microbatches=m,
        virtual_stages=v,
        tune_splits=draw(st.integers(0, 3)),
        zero=draw(st.integers(0, 3)),
        offload=draw(st.booleans()),
        recompute=draw(st.booleans()),
    )
    batch = dp * m * draw(st.integers(1, 3))
    job = Job(
        dataclasses.replace(MODEL, batch=batch),
        precision=draw(st.sampled_from(sorted(DTYPE_BYTES))),
        optimizer=draw(st.sampled_from(sorted(OPTIMIZER_BYTES))),
    )
    return layout, job


@settings(max_examples=150, deadline=None)
@given(valid_layouts())
def test_valid_layouts_give_no_lines(case: tuple[Layout, Job]) -> None:
    layout, job = case
    assert check(layout, job) == []


@settings(max_examples=50, deadline=None)
@given(valid_layouts())
def test_a_layout_is_the_comm_packages_degrees(case: tuple[Layout, Job]) -> None:
    """`Layout` is a `tessera.comm.Degrees` (the same fields, the same world size) and hands
    its degrees on alone; its tensor-parallel shape is the mode, degree and depth it holds."""
    layout, _ = case
    assert isinstance(layout, Degrees)
    assert {f.name for f in dataclasses.fields(Degrees)} == set(DEGREE_NAMES)
    assert set(DEGREE_NAMES) <= {f.name for f in dataclasses.fields(Layout)}
    assert layout.world_size == layout.dp * layout.pp * layout.tp * layout.cp
    alone = layout.degrees()
    assert type(alone) is Degrees and alone.world_size == layout.world_size
    assert alone == Degrees(**{name: getattr(layout, name) for name in DEGREE_NAMES})
    shape = layout.shape
    assert (shape.mode, shape.tp, shape.depth) == (layout.tp_mode.value, layout.tp, layout.tp_depth)
    assert shape.ways == (layout.tp // layout.tp_depth if shape.mode == "2.5d" else layout.tp)


DEGREES = ("dp", "pp", "tp", "cp", "tp_depth", "microbatches", "virtual_stages", "ep")


@settings(max_examples=100, deadline=None)
@given(
    bad=st.dictionaries(st.sampled_from(DEGREES), st.integers(-5, 0), min_size=1),
    others=st.dictionaries(st.sampled_from(["zero", "tune_splits"]), st.integers(-3, 9)),
)
def test_every_degree_below_one_is_named_and_nothing_else_is_reported(
    bad: dict[str, int], others: dict[str, int]
) -> None:
    """With a degree below 1 there is nothing else to model: exactly one line per bad degree,
    in the order `check` reads them, naming its value (other faults wait for those)."""
    layout = Layout(**bad, **others)  # type: ignore[arg-type]
    job = Job(MODEL, precision="fp8")
    want = [f"layout.{name} must be >= 1, got {bad[name]}" for name in DEGREES if name in bad]
    assert check(layout, job) == want


# Each fault: (what it changes in the layout, what in the job, the line it must give). The
# base below is valid, and no two faults touch the same field, so any set of them is a
# layout with exactly those faults.
BASE = {"dp": 2, "pp": 2, "tp": 2, "microbatches": 4, "schedule": "1f1b", "zero": 1}
FAULTS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "zero": ({"zero": 4}, {}, r"layout\.zero=4 must be 0, 1, 2 or 3"),
    "tune_splits": ({"tune_splits": -1}, {}, r"layout\.tune_splits must be >= 0, got -1"),
    "grid": (
        {"tp": 2, "tp_mode": "2d"},
        {},
        r"layout: tp=2 is not a square q\*q: tp_mode 2d needs a q x q grid",
    ),
    "schedule": (
        {"schedule": "pipedream"},
        {},
        r"layout\.schedule='pipedream' is not one of 1f1b, gpipe, interleaved-1f1b, zb-h1, zbv",
    ),
    "chunks": (
        {"virtual_stages": 3},
        {},
        r"layout \(pp=2, microbatches=4\): 1f1b always places 1 chunk\(s\) per rank; got v=3",
    ),
    "precision": ({}, {"precision": "fp8"}, r"job\.precision='fp8' is not one of fp32, bf16, fp16"),
    "optimizer": ({}, {"optimizer": "lion"}, r"job\.optimizer='lion' is not one of adamw, adam, sgd"),
    "ep": ({"ep": 2}, {}, r"layout\.ep=2 but the job has no experts \(job\.moe\)"),
    "batch": ({}, {"batch": 12}, r"job: batch 12 is not divisible by dp \* microbatches = 2 \* 4 = 8"),
}


@settings(max_examples=150, deadline=None)
@given(st.sets(st.sampled_from(sorted(FAULTS))))
def test_every_fault_is_named_in_a_line_of_its_own(faults: set[str]) -> None:
    """Any combination of faults (the schedule's name and its chunk count being one field:
    an unknown schedule has no rules to break) gives one line per fault, each naming the
    values, and nothing else; no fault gives no line."""
    if {"schedule", "chunks"} <= faults:
        faults = faults - {"chunks"}
    layout_kw: dict[str, Any] = dict(BASE)
    job_kw: dict[str, Any] = {}
    for name in faults:
        layout_change, job_change, _ = FAULTS[name]
        layout_kw |= layout_change
        job_kw |= job_change
    model = dataclasses.replace(MODEL, batch=job_kw.pop("batch", 16))
    lines = check(Layout(**layout_kw), Job(model, **job_kw))
    assert len(lines) == len(faults), lines
    for name in faults:
        pattern = FAULTS[name][2]
        assert sum(1 for line in lines if re.search(pattern, line)) == 1, (name, lines)


@pytest.mark.parametrize(
    ("grid", "pattern"),
    [
        ({"tp": 4, "tp_depth": 2}, r"depth=2 is only meaningful for tp_mode 2\.5d, not 1d"),
        ({"tp": 6, "tp_mode": "2d"}, r"tp=6 is not a square q\*q"),
        ({"tp": 4, "tp_mode": "3d"}, r"tp=4 is not a cube q\*q\*q"),
        ({"tp": 8, "tp_mode": "2.5d", "tp_depth": 3}, r"tp=8 is not q\*q\*depth: depth=3 does not divide it"),
        ({"tp": 6, "tp_mode": "2.5d", "tp_depth": 2}, r"tp/depth = 3 is not a square"),
    ],
)
def test_a_degree_no_grid_of_its_mode_names_tp_depth_and_mode(grid: dict[str, Any], pattern: str) -> None:
    lines = check(Layout(microbatches=1, **grid), Job(MODEL))
    assert len(lines) == 1 and lines[0].startswith("layout: ") and re.search(pattern, lines[0]), lines


def test_the_megatron_rule_of_interleaving_is_the_pipelines_line() -> None:
    """An interleaved schedule whose microbatches the pipeline ranks do not divide: the
    schedule spec's own line, prefixed with the pipeline ranks and microbatches."""
    layout = Layout(pp=3, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    want = schedule_spec("interleaved-1f1b").check(3, 4, 2)
    assert len(want) == 1
    assert check(layout, Job(dataclasses.replace(MODEL, batch=4))) == [
        f"layout (pp=3, microbatches=4): {want[0]}"
    ]
    assert check(dataclasses.replace(layout, microbatches=6), Job(dataclasses.replace(MODEL, batch=6))) == []


MOE = ExpertShape(layers=2, experts=8, top_k=2, hidden=64)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"dp": 4, "ep": 3}, r"layout\.ep=3 must divide dp=4 and the experts \(8\)"),
        ({"dp": 6, "ep": 3, "microbatches": 1}, r"layout\.ep=3 must divide dp=6 and the experts \(8\)"),
        ({"dp": 2, "ep": 2, "pp": 2}, r"experts are modelled at pp = cp = 1, got pp=2 cp=1"),
        ({"dp": 2, "ep": 2, "cp": 2}, r"experts are modelled at pp = cp = 1, got pp=1 cp=2"),
        ({"dp": 2, "ep": 2, "tp": 4, "tp_mode": "2d"}, r"experts are modelled under 1D tp, got tp=4 2d"),
    ],
)
def test_what_the_planner_cannot_model_of_experts_is_named(change: dict[str, Any], pattern: str) -> None:
    layout = Layout(**{"microbatches": 2, **change})
    lines = check(layout, Job(dataclasses.replace(MODEL, batch=48), moe=MOE))
    assert len(lines) == 1 and re.search(pattern, lines[0]), lines
    valid = Layout(dp=4, ep=4, tp=2, microbatches=2, sequence_parallel=True)
    assert check(valid, Job(dataclasses.replace(MODEL, batch=48), moe=MOE)) == []
    too_deep = dataclasses.replace(MOE, layers=MODEL.layers + 1)
    assert check(valid, Job(dataclasses.replace(MODEL, batch=48), moe=too_deep)) == [
        f"job.moe.layers={MODEL.layers + 1} is more than the model's {MODEL.layers} layers"
    ]


@pytest.mark.parametrize(
    ("field", "value", "known"),
    [
        ("tp_mode", "4d", "1d, 2d, 2.5d, 3d"),
        ("cp_mode", "tree", "ring, ulysses"),
        ("cp_layout", "x", "contiguous, zigzag"),
    ],
)
def test_an_unknown_mode_is_refused_naming_the_known_ones(field: str, value: str, known: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"layout.{field}={value!r} is not one of {known}")):
        Layout(**{field: value})  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(valid_layouts())
def test_a_layout_takes_the_names_of_its_modes_as_their_members(case: tuple[Layout, Job]) -> None:
    layout, _ = case
    named = dataclasses.replace(
        layout,
        tp_mode=layout.tp_mode.value,
        cp_mode=layout.cp_mode.value,
        cp_layout=layout.cp_layout.value,
    )
    assert named == layout and hash(named) == hash(layout)
    assert named.tp_mode is layout.tp_mode and isinstance(named.tp_mode, TPMode)


@settings(max_examples=80, deadline=None)
@given(valid_layouts())
def test_the_label_shows_each_setting_it_describes(case: tuple[Layout, Job]) -> None:
    """The label names the degrees, the microbatches and the ZeRO stage; the schedule only
    under a pipeline, context parallelism only when there is some, and each flag when set."""
    p, _ = case
    words = p.label().split()
    assert words[0] == f"dp{p.dp}" and words[1] == f"pp{p.pp}" and words[2].startswith(f"tp{p.tp}")
    assert f"m{p.microbatches}" in words
    assert f"z{p.zero}" + ("+off" if p.offload else "") in words
    assert ("recompute" in words) == p.recompute
    assert words[2].endswith("+sp") == p.sequence_parallel
    assert any(w.startswith("cp") for w in words) == (p.cp > 1)
    if p.cp > 1:
        assert f"cp{p.cp}/{p.cp_mode.value}" in words
    assert any(w.startswith(p.schedule) for w in words[3:]) == (p.pp > 1)
    assert (f"/{p.tp_mode.value}" in words[2]) == (p.tp_mode is not TPMode.ONE_D)
