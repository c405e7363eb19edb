"""Degrees for a world that changed size: an elastic job (``--nnodes MIN:MAX``) restarted on
fewer nodes keeps its model-parallel degrees (tp, pp, cp) and lets data parallelism take the
processes there are. Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

from tessera.launcher.config.boost_config import BoostConfig
from tessera.launcher.config.main_config import Config

__all__ = ["ELASTIC_ENV", "at_world", "elastic_problems"]

ELASTIC_ENV = "TESSERA_ELASTIC"  # set by the launcher when the job may run on fewer nodes

C = TypeVar("C", bound=BoostConfig)


def at_world(config: C, world: int) -> C:
    """``config`` with ``parallel.dp`` = ``world`` over the other degrees (ValueError naming
    the numbers when they do not divide it)."""
    p = config.parallel
    per_replica = p.tp * p.pp * p.cp
    if world < 1 or world % per_replica:
        raise ValueError(
            f"{world} processes do not split into replicas of tp * pp * cp = "
            f"{p.tp} * {p.pp} * {p.cp} = {per_replica}"
        )
    return dataclasses.replace(config, parallel=dataclasses.replace(p, dp=world // per_replica))


def elastic_problems(config: Config, worlds: Iterable[int], *, main_job: bool) -> list[str]:
    """What stops ``config`` from running at each of ``worlds`` (its dp set from the world),
    one line per world; empty when every world works."""
    lines = []
    for world in worlds:
        try:
            adjusted = at_world(config, world)
        except ValueError as exc:
            lines.append(f"at {world} processes: {exc}")
            continue
        errors = adjusted.validate() if main_job else adjusted.validate_fields()
        lines += [f"at {world} processes (dp {adjusted.parallel.dp}): {e}" for e in errors]
    return lines
