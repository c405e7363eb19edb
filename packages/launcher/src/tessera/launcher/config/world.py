"""A configuration's degrees for the world it runs in (`tessera.launcher.config.world_rule`: a
degree of -1 takes what the others leave, and with none set dp fills the world).

The world size is known before anything spawns under ``tessera run`` and ``tessera train``
(processes per node times nodes), from ``WORLD_SIZE`` under plain ``torchrun`` (or any launcher
that sets torch's environment: ``srun`` with it exported, Kubernetes, cloud job launchers), and
from the default process group in ``boost()``. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar

from tessera.launcher.config.boost_config import BoostConfig
from tessera.launcher.config.world_rule import auto_degrees, infer_degrees

__all__ = ["WORLD_SIZE_ENV", "fit_world", "known_world_size", "world_from_env"]

WORLD_SIZE_ENV = "WORLD_SIZE"  # set by torchrun (and read by torch's env:// rendezvous) for every process

C = TypeVar("C", bound=BoostConfig)


def fit_world(config: C, world: int) -> C:
    """``config`` with its pp, dp, cp and tp inferred for ``world`` processes (`infer_degrees`;
    ValueError naming the numbers); the same object when nothing changes."""
    p = config.parallel
    inferred = infer_degrees(p.degree_values(), world)
    if all(getattr(p, name) == value for name, value in inferred.items()):
        return config
    parallel = dataclasses.replace(
        p, pp=inferred["pp"], dp=inferred["dp"], cp=inferred["cp"], tp=inferred["tp"]
    )
    return dataclasses.replace(config, parallel=parallel)


def known_world_size(config: BoostConfig) -> int | None:
    """The world size the degrees ask for, or None while one of them is -1 (auto)."""
    return None if auto_degrees(config.parallel.degree_values()) else config.world_size


def world_from_env(env: Mapping[str, str]) -> int | None:
    """``WORLD_SIZE`` of torch's environment (torchrun sets it), or None when it is not set;
    ValueError naming it when it is not a whole number >= 1."""
    text = env.get(WORLD_SIZE_ENV)
    if text is None or not text.strip():
        return None
    try:
        world = int(text)
    except ValueError:
        raise ValueError(f"{WORLD_SIZE_ENV}={text!r} is not a whole number") from None
    if world < 1:
        raise ValueError(f"{WORLD_SIZE_ENV}={text!r} must be >= 1")
    return world
