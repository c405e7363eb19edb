"""The one registry of pipeline schedules: name -> `ScheduleSpec`.

Built in: ``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1``, ``zbv``. A research user adds
a schedule with `register_schedule` (no edit of Tessera); every consumer (launcher config
checks, partitioner, runtime tests, benchmarks) asks `schedule_spec(name)` for its layout,
chunks per rank and rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tessera.pipeline.actions import Schedule
from tessera.pipeline.schedules import GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B
from tessera.pipeline.spec import ScheduleSpec
from tessera.pipeline.zero_bubble import ZB_H1, ZBV

__all__ = ["SCHEDULES", "build_schedule", "register_schedule", "schedule_spec"]

_SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec for spec in (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ZB_H1, ZBV)
}

SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType(_SPECS)
"""Every registered schedule by name (a read-only view; add with `register_schedule`)."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered spec called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known: {sorted(_SPECS)}") from None


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add ``spec`` to the registry under ``spec.name`` and return it.

    Refuses (``ValueError``) a name that is already registered.
    """
    if spec.name in _SPECS:
        raise ValueError(
            f"a schedule named {spec.name!r} is already registered; pick another name "
            f"(registered: {sorted(_SPECS)})"
        )
    _SPECS[spec.name] = spec
    return spec


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """Build the named schedule: ``schedule_spec(name).build(p, m, v)``.

    ``v`` is the number of chunks per rank; ``None`` takes the schedule's default.
    """
    return schedule_spec(name).build(p, m, v)
