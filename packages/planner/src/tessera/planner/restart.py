"""What one restart after a lost node costs a job, in seconds of the whole job's time.

``restart_cost`` adds four terms:

- **detect**: the lost node is named once its heartbeat has not moved for the watchdog
  timeout (``train.watchdog_s``), plus up to one beat interval (a tenth of it, at most 2 s).
- **relaunch**: every remaining node starts its processes again and meets at a new
  rendezvous: ``relaunch_s`` as measured on a small job (process start, imports, the
  rendezvous' last call for late nodes), plus the rendezvous' join messages, one per node
  through the store of node 0 (``store_message_s`` each, in turn).
- **load**: each rank reads its share of the last checkpoint generation, the parameters and
  optimizer state (masters included) the planner predicts for its fullest rank, at
  ``disk_bandwidth`` bytes/s per node shared by the node's ranks; ``copy_from_peer``: without
  shared storage, a node that lost its own copy first copies it from another node, at the
  inter-node bandwidth.
- **redo**: the steps since the last committed generation are lost and trained again: on
  average half the checkpoint interval, at the predicted step time.

All terms are estimates for planning (which checkpoint interval, which watchdog timeout); the
benchmark ``bench multinode`` measures them on a small job.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.cluster import Cluster
from tessera.planner.estimate import Estimate

__all__ = ["RestartCost", "restart_cost"]


@dataclass(frozen=True)
class RestartCost:
    """Seconds of each term of one restart (module docstring)."""

    detect: float
    relaunch: float
    load: float
    redo: float

    @property
    def total(self) -> float:
        return self.detect + self.relaunch + self.load + self.redo


def restart_cost(
    estimate: Estimate,
    cluster: Cluster,
    *,
    watchdog_s: float,
    checkpoint_every: int,
    relaunch_s: float,
    disk_bandwidth: float,
    store_message_s: float = 1e-3,
    copy_from_peer: bool = False,
) -> RestartCost:
    """One restart of the job ``estimate`` describes on ``cluster`` (its ``nodes`` the nodes that
    remain); ValueError naming a value that is not positive."""
    for name, value in (("watchdog_s", watchdog_s), ("checkpoint_every", checkpoint_every)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if disk_bandwidth <= 0 or relaunch_s < 0:
        raise ValueError(
            f"disk_bandwidth must be > 0 and relaunch_s >= 0, got {disk_bandwidth}, {relaunch_s}"
        )
    detect = watchdog_s + min(2.0, max(0.1, watchdog_s / 10))
    relaunch = relaunch_s + cluster.nodes * store_message_s
    per_node = (estimate.memory.parameters + estimate.memory.optimizer_state) * cluster.devices_per_node
    load = per_node / disk_bandwidth
    if copy_from_peer:
        load += per_node / (cluster.inter_bandwidth * cluster.devices_per_node)
    redo = checkpoint_every / 2 * estimate.time.total
    return RestartCost(detect, relaunch, load, redo)
