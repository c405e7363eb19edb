"""ScheduleSpec and the registry: chunks, rules, placement, and a user-registered schedule."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tessera.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    Layout,
    ScheduleSpec,
    build_schedule,
    partition_by_cost,
    register_schedule,
    schedule_spec,
    simulate,
    stage_to_rank,
    validate,
)
from tessera.pipeline import registry as registry_module


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Registrations made by a test are removed after it (the registry is process-wide)."""
    before = dict(SCHEDULES)
    yield
    specs = registry_module._SPECS
    specs.clear()
    specs.update(before)


def layer_by_layer(p: int, m: int, ranks: tuple[int, ...]) -> list[list[Action]]:
    """A trivial reordering of GPipe for any placement: each rank runs the forwards of its
    stages in model order, then the backwards of its stages last-in first-out."""
    orders = []
    for r in range(p):
        mine = [s for s, owner in enumerate(ranks) if owner == r]
        forward = [Action(ActionKind.F, i, s) for s in mine for i in range(m)]
        backward = [Action(ActionKind.BW, i, s) for s in reversed(mine) for i in reversed(range(m))]
        orders.append(forward + backward)
    return orders


def at_least_two_microbatches(p: int, m: int, v: int) -> str | None:
    return None if m >= 2 else f"gpipe-lifo-v needs m >= 2 microbatches; got m={m}"


LIFO_V = ScheduleSpec(
    "gpipe-lifo-v",
    layer_by_layer,
    layout=Layout.V,
    default_chunks=2,
    min_chunks=1,
    rules=(at_least_two_microbatches,),
)


def test_registered_schedule_builds_validates_and_simulates(clean_registry: None) -> None:
    assert register_schedule(LIFO_V) is LIFO_V
    assert schedule_spec("gpipe-lifo-v") is SCHEDULES["gpipe-lifo-v"] is LIFO_V
    for p, m, v in [(1, 2, None), (3, 4, None), (3, 5, 3), (4, 2, 1)]:
        sch = build_schedule("gpipe-lifo-v", p, m, v)
        validate(sch)
        assert sch.stage_to_rank == stage_to_rank(Layout.V, p, LIFO_V.chunks(v))
        result = simulate(sch, Costs(f=1, b=1, w=0))
        assert result.makespan > 0
        assert max(result.peak_in_flight) == m * LIFO_V.chunks(v)
    sch = build_schedule("gpipe-lifo-v", 3, 4)
    part = partition_by_cost([1.0] * 12, schedule=sch)
    assert part.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert LIFO_V.check(3, 1, 2) == ["gpipe-lifo-v needs m >= 2 microbatches; got m=1"]
    with pytest.raises(ValueError, match="needs m >= 2 microbatches; got m=1"):
        build_schedule("gpipe-lifo-v", 3, 1)


def test_duplicate_names_are_refused(clean_registry: None) -> None:
    with pytest.raises(ValueError, match="'zbv' is already registered"):
        register_schedule(ScheduleSpec("zbv", layer_by_layer))
    register_schedule(LIFO_V)
    with pytest.raises(ValueError, match="'gpipe-lifo-v' is already registered"):
        register_schedule(LIFO_V)


def test_registry_is_read_only_and_names_known_schedules() -> None:
    with pytest.raises(TypeError):
        SCHEDULES["x"] = LIFO_V  # type: ignore[index]
    with pytest.raises(ValueError, match=r"unknown schedule 'x'; known: \[.*'zbv'"):
        schedule_spec("x")


def test_check_reports_every_broken_rule() -> None:
    interleaved = schedule_spec("interleaved-1f1b")
    assert interleaved.check(0, 0, 0) == [
        "interleaved-1f1b needs p >= 1 pipeline ranks; got p=0",
        "interleaved-1f1b needs m >= 1 microbatches; got m=0",
        "interleaved-1f1b needs v >= 1 chunks per rank; got v=0",
    ]
    assert schedule_spec("zbv").check(2, 0, 3) == [
        "zbv needs m >= 1 microbatches; got m=0",
        "zbv always places 2 chunk(s) per rank; got v=3",
    ]
    with pytest.raises(ValueError, match="got p=0; interleaved-1f1b needs m >= 1"):
        interleaved.build(0, 0, 0)


def test_chunks_and_placement() -> None:
    for spec in SCHEDULES.values():
        v = spec.chunks()
        assert spec.stage_to_rank(3) == stage_to_rank(spec.layout, 3, v)
        assert spec.fixed_chunks == (spec.min_chunks is None)
    assert schedule_spec("interleaved-1f1b").chunks(3) == 3
    with pytest.raises(ValueError, match=r"1f1b always places 1 chunk.*got v=2"):
        schedule_spec("1f1b").chunks(2)
    with pytest.raises(ValueError, match=r"zbv always places 2 chunk.*got v=1"):
        schedule_spec("zbv").stage_to_rank(2, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "non-empty name"),
        ({"default_chunks": 0}, "min_chunks=None, default_chunks=0"),
        ({"default_chunks": 2, "min_chunks": 3}, "min_chunks=3, default_chunks=2"),
        ({"min_chunks": 0}, "min_chunks=0, default_chunks=1"),
    ],
)
def test_impossible_specs(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"name": "s", "generator": layer_by_layer, **kwargs}
    with pytest.raises(ValueError, match=match):
        ScheduleSpec(**args)  # type: ignore[arg-type]


def test_a_generator_with_the_wrong_rank_count_is_refused() -> None:
    spec = ScheduleSpec("short", lambda p, m, ranks: layer_by_layer(p, m, ranks)[:-1])
    with pytest.raises(ValueError, match="short's generator gave 1 rank orders for p=2"):
        spec.build(2, 2)
