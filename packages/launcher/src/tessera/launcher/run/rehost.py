"""Who hosts the next attempt's rendezvous, when a node is lost.

The rendezvous and the node watch live on one node, node 0 at first. `next_host` keeps it
there unless the watch named that node lost; then the lowest node left hosts them, at the
address it told the watch (this node's own, when it is that node).

Nodes that cannot reach each other cannot tell a dead host from a partition: each side of a
partition names the other lost. Where the nodes share the run folder (shared storage), the host
holds a lease there (`Lease`: a file it touches every second); a node about to take over first
watches that file for up to ``train.watchdog_s``: if it moves, the host is alive beyond the
partition and goes on with the job, so this node ends instead of training apart into the same
folder; if it does not (or there is none: each node its own disk), the node takes over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tessera.launcher.run.liveness import NodeWatch
from tessera.launcher.run.nodes import NodePlan, endpoint_of, endpoint_port

__all__ = ["Lease", "lease_moves", "next_host"]

LEASES = ".rendezvous"
PERIOD_S = 1.0


def _lease(run: Path, node: int) -> Path:
    return run / LEASES / f"host-{node}"


class Lease:
    """While open, node ``node`` touches its lease in ``run`` every second (module docstring)."""

    def __init__(self, run: Path, node: int) -> None:
        self.path = _lease(run, node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tessera-host-lease", daemon=True)

    def __enter__(self) -> Lease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_S):
            with contextlib.suppress(OSError):
                self.path.touch()


def lease_moves(run: Path, node: int, within_s: float) -> bool:
    """Whether node ``node``'s lease in ``run`` is touched within ``within_s`` seconds (False
    at once when there is none, or it is older than that already)."""
    path = _lease(run, node)
    try:
        first = path.stat().st_mtime_ns
    except OSError:
        return False
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            now = path.stat().st_mtime_ns
        except OSError:
            return False
        if now != first:
            return True
        if time.time() - now / 1e9 > within_s:
            return False
        time.sleep(PERIOD_S / 4)
    return False


def next_host(
    plan: NodePlan, watch: NodeWatch, say: Callable[[str], None], run: Path | None, stale_s: float
) -> NodePlan | None:
    """The plan of the next attempt: its host kept, or, when the watch named it lost, the
    lowest node left at its address (same port); None (said why) when this node must end
    instead: the host still holds the shared run folder, or no address is known."""
    old = plan.host_node
    if old not in watch.lost_nodes:
        return plan
    if run is not None and lease_moves(run, old, stale_s):
        say(
            f"node {old} is out of reach but still holds the run folder (its lease there moves): "
            "the job goes on there; this node ends"
        )
        return None
    left = [n for n in range(plan.nnodes) if n not in watch.lost_nodes]
    if not left:
        return None
    host = left[0]
    address = plan.local_addr if host == plan.node_rank else watch.addresses.get(host)
    if not address:
        say(f"the rendezvous host (node {old}) is lost and node {host}'s address is unknown")
        return None
    endpoint = endpoint_of(address, endpoint_port(plan.rdzv_endpoint))
    say(f"node {host} ({address}) hosts the rendezvous from now on (node {old} is lost)")
    return dataclasses.replace(plan, rdzv_endpoint=endpoint, host_node=host)
