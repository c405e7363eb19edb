"""``parallel.auto = true``: the launcher runs the planner's choice.

Before anything spawns, `auto_launch` resolves the cluster the configuration names
(``parallel.cluster``: a preset, a cluster TOML, or empty for the file ``tessera plan
--calibrate`` wrote at `calibrated_path`, else the ``cpu`` preset, whose device count is this
machine's core count), refusing an unknown one with a ValueError; the world is the
launcher's processes per node (default: the cluster's devices per node) times its nodes.
`auto_config` then replaces the ``[parallel]`` and ``[zero]`` sections by those of the
fastest candidate that fits (``search``) for that world. The result has ``parallel.auto =
false`` and concrete degrees, so every rank's ``load_config()`` and every checkpoint see
exactly what runs.
"""

from __future__ import annotations

import dataclasses

from tessera.launcher.config import Config
from tessera.launcher.plan.cluster import Cluster, calibrated_path, resolve_cluster
from tessera.launcher.plan.search import Candidate, search

__all__ = ["auto_config", "auto_launch", "calibrated_path"]


def auto_config(config: Config, world: int, cluster: Cluster | None = None) -> tuple[Config, Candidate]:
    """``config`` with the planner's parallel layout and ZeRO settings for ``world`` ranks of
    ``cluster`` (default: the one ``parallel.cluster`` names), and the chosen candidate;
    ValueError naming the world when nothing fits, or naming an unknown cluster."""
    cluster = resolve_cluster(config.parallel.cluster) if cluster is None else cluster
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
    parallel = dataclasses.replace(best.config.parallel, auto=False, cluster=config.parallel.cluster)
    chosen = dataclasses.replace(config, parallel=parallel, zero=best.config.zero)
    return chosen, best


def auto_launch(config: Config, nproc_per_node: int | None, nnodes: int) -> tuple[Config, Candidate, int]:
    """What the launcher runs for ``parallel.auto``: (the chosen config, its candidate, the
    processes per node), planned on ``parallel.cluster`` for ``nproc_per_node`` (default the
    cluster's devices per node) times ``nnodes`` ranks; ValueError for an unknown cluster or
    when nothing fits."""
    cluster = resolve_cluster(config.parallel.cluster)
    per_node = nproc_per_node or cluster.devices_per_node
    chosen, best = auto_config(config, per_node * nnodes, cluster)
    return chosen, best, per_node
