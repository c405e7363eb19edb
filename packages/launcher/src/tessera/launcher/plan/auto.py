"""``parallel.auto = true``: the launcher runs the planner's choice.

Before anything spawns, `auto_config` replaces the ``[parallel]`` and ``[zero]`` sections of
a configuration by those of the fastest candidate that fits (``search``) for the world the
launcher is about to start, on the ``cpu`` preset (this machine) unless another cluster is
given. The result has ``parallel.auto = false`` and concrete degrees, so every rank's
``load_config()`` and every checkpoint see exactly what runs. For a cluster that is not
this machine, run ``tessera plan --cluster ... --out winner.toml`` and launch that instead.
"""

from __future__ import annotations

import dataclasses

from tessera.launcher.config import Config
from tessera.launcher.plan.cluster import PRESETS, Cluster
from tessera.launcher.plan.search import Candidate, search

__all__ = ["auto_config"]


def auto_config(config: Config, world: int, cluster: Cluster | None = None) -> tuple[Config, Candidate]:
    """``config`` with the planner's parallel layout and ZeRO settings for ``world`` ranks,
    and the chosen candidate; ValueError naming the world when nothing fits."""
    cluster = PRESETS["cpu"] if cluster is None else cluster
    if world < 1:
        raise ValueError(f"parallel.auto needs a world of at least 1 rank, got {world}")
    result = search(config, cluster, world=world, recompute=(False, True))
    best = result.best
    if best is None:
        raise ValueError(
            f"parallel.auto: no configuration of this model fits {world} rank(s) of {cluster.name} "
            f"({cluster.memory_gib:g} GiB each; {result.invalid} refused by validation, "
            f"{len(result.too_big) + result.overflow} too big)"
        )
    chosen = dataclasses.replace(
        config, parallel=dataclasses.replace(best.config.parallel, auto=False), zero=best.config.zero
    )
    return chosen, best
