"""Nodes watch each other: a node that stops answering is named, and its job ends everywhere.

On several nodes every ``tessera run`` keeps a ``NodeWatch`` for the whole run. The host node's
(node 0's, at first) hosts a small key-value store (torch's TCPStore) at the rendezvous host, on
the port after the rendezvous port; every node's watch connects to it, says which node it is (its
host, its own address and the global ranks of its workers, read from the local heartbeats) and
counts up a heartbeat every ``interval`` seconds, per attempt of the job (a restart is a new
attempt). It reads the other
nodes' counts: a node of the current attempt whose count has not moved for ``timeout_s`` (the
watchdog's ``train.watchdog_s``), or a store that stops answering (the host is gone), is lost:
the watch says so in one line, naming the node, its host and its ranks, and calls
``on_lost`` (the launcher kills its own workers, so the step ends here too instead of waiting
in a collective for gloo's timeout). A node that finishes says so, and is not missed; it stops
watching, and the host keeps its store up until every other node of the attempt has said so too
(or ``timeout_s`` passed), so that no node misses the host's store at the very end of a run.
When the host is lost, this process's connections to it are cut (``sever``: calls on a store
whose host vanished without a reset would wait far past their timeouts), and the launcher names
the lowest node left as the next host (``move``): that node's watch hosts the store at its own
address, the others connect there.

The watch never stops a launch: if it cannot reach the store, it logs why and watches nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from tessera.launcher.run.netif import resolve
from tessera.launcher.run.sever import sever
from tessera.launcher.run.watchdog import read_beats

__all__ = ["NodeWatch", "watch_port"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def watch_port(rdzv_port: int) -> int:
    """The port of node 0's watch store: the one after the rendezvous port."""
    return rdzv_port + 1


class NodeWatch:
    """One node's side (module docstring); a context manager around the whole run."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        node_rank: int,
        nnodes: int,
        timeout_s: float,
        heartbeats: Path,
        report: Callable[[str], None],
        on_lost: Callable[[], None],
        interval: float | None = None,
        address: str | None = None,
    ) -> None:
        self.host, self.port, self.node, self.nnodes = host, port, node_rank, nnodes
        self.host_node = 0  # the node hosting the store (`move`: a survivor, after it is lost)
        self.address = address  # this node's own address, told to the others (a future host's)
        self.addresses: dict[int, str] = {}  # the other nodes' addresses, as they told them
        self.lost_nodes: set[int] = set()  # every node named lost in this run
        self._call_s = max(2.0, min(10.0, timeout_s / 2))  # the longest a store call may take
        self.timeout_s = timeout_s
        self.interval = interval if interval is not None else max(0.2, min(2.0, timeout_s / 10))
        self.heartbeats, self.report, self.on_lost = heartbeats, report, on_lost
        self.attempt = 0
        self.lost: list[str] = []  # the lines said about lost nodes, this attempt
        self._finished = False  # this node's workers ended normally: nothing more to watch
        self._store: Any = None
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (count, when it last moved)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._moved = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tessera-node-watch", daemon=True)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> NodeWatch:
        import torch.distributed  # noqa: F401  # here, not first in the watch's thread beside the launcher's imports

        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def begin(self, attempt: int) -> None:
        """A new attempt of the job starts on this node (every node counts its attempts alike)."""
        with self._lock:
            self.attempt, self.lost, self._seen = attempt, [], {}

    def move(self, host_node: int, host: str) -> None:
        """The store moves to node ``host_node`` at ``host`` (the same port), for the next
        attempt: the lowest node left after the host was lost; that node hosts it itself."""
        with self._lock:
            self.host_node, self.host = host_node, host
            self._store, self._seen = None, {}
        self._moved.set()

    def settle(self) -> list[str]:
        """After this node's rank watchdog fired: wait until every other node of this attempt has
        beaten since, or one is named lost, and return the lines said about lost nodes (empty
        when every node is alive: the hang is the ranks' own).

        The ranks of a node wait in a collective for a lost node from their last optimizer
        step on, up to a step before the node vanished, so the rank watchdog can fire before
        the node's heartbeat is ``timeout_s`` old; settling names the node as the cause. It
        takes one beat or two when every node is alive, and at most ``timeout_s`` and two beats
        more (the watch's own bound) when one is not. "Beaten since" is a node's count in the
        store moving past what it was when settling began (not this watch noticing a move: it
        may notice a node's last beat after settling began); a node whose count has not moved
        by the bound is named here, should the watch's thread not have named it yet."""
        since = time.monotonic()
        deadline = since + self.timeout_s + 2 * self.interval
        with self._lock:
            if self.lost or self._store is None:
                return list(self.lost)
            store, a = self._store, self.attempt
            try:
                seen = list(self._seen)
                start = _within(self._call_s, lambda: {n: int(store.add(f"beat/{a}/{n}", 0)) for n in seen})
            except (RuntimeError, OSError):  # the host node is gone: the watch names it
                start = {n: count for n, (count, _) in self._seen.items()}
        while True:
            with self._lock:
                if self.lost or self._store is None:
                    return list(self.lost)
                silent = [n for n, c in start.items() if n in self._seen and self._seen[n][0] <= c]
                if not silent:
                    return []
                if time.monotonic() > deadline:
                    with contextlib.suppress(RuntimeError, OSError):
                        self._declare(
                            {n: self._lost_line(store, n, time.monotonic() - since) for n in silent}
                        )
                    return list(self.lost)
            if self._stop.wait(self.interval / 2):
                with self._lock:
                    return list(self.lost)

    def finish(self) -> None:
        """This node's workers ended normally in this attempt: the others do not miss it, and
        this node watches no more. Node 0 then waits (at most ``timeout_s``) until every other
        node of the attempt has finished too: its store must outlive their last beats."""
        with self._lock:
            self._finished = True
            store = self._store
            with contextlib.suppress(Exception):
                if store is not None:
                    done = f"done/{self.attempt}/{self.node}"
                    _within(self._call_s, lambda: store.set(done, "1"))
        if self.node != self.host_node or store is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            with self._lock, contextlib.suppress(Exception):
                if self._all_done(store):
                    return
            time.sleep(self.interval / 2)
        log.warning("node watch: not every node said it finished within %g s", self.timeout_s)

    def _all_done(self, store: Any) -> bool:
        a = self.attempt
        joined = [n for n in range(self.nnodes) if n != self.node and store.check([f"node/{a}/{n}"])]
        return all(store.check([f"done/{a}/{n}"]) for n in joined)

    # ------------------------------------------------------------------ the loop
    def _connect(self) -> Any:
        from torch._C._distributed_c10d import TCPStore  # torch.distributed's, typed

        deadline = time.monotonic() + max(30.0, self.timeout_s)
        while not self._stop.is_set():
            try:
                return TCPStore(
                    self.host,
                    self.port,
                    is_master=self.node == self.host_node,
                    timeout=timedelta(seconds=self._call_s),
                    wait_for_workers=False,
                )
            except (RuntimeError, OSError) as exc:  # the host not up yet, or its port is taken
                if self.node == self.host_node or time.monotonic() > deadline:
                    log.warning("node watch off: no store at %s:%d (%s)", self.host, self.port, exc)
                    return None
                self._stop.wait(0.5)
        return None

    def _loop(self) -> None:
        """Watch through the host's store; when the host is lost, wait for `move` and watch
        through the new host's."""
        while not self._stop.is_set():
            store = self._connect()
            with self._lock:
                self._store = store
            if store is None or not self._watch(store):
                return
            while not self._moved.wait(0.2):  # the host is gone: until spawn names the next one
                if self._stop.is_set():
                    return
            self._moved.clear()

    def _watch(self, store: Any) -> bool:
        """Beat and read the others through ``store`` until the watch ends (False) or the store
        stops answering, its host lost (True)."""
        while not self._stop.wait(self.interval):
            if self._moved.is_set():  # another node hosts the store from the next attempt on
                return True
            try:
                with self._lock:
                    if self._finished:
                        return False
                    now = time.monotonic()
                    lost = _within(self._call_s, lambda: self._beat(store, now))  # noqa: B023  (waited for)
            except (RuntimeError, OSError) as exc:  # the store stopped answering: its host is gone
                if self.node == self.host_node:
                    log.warning("node watch: its own store failed (%s)", exc)
                    return False
                n, where = self.host_node, f"{self.host}:{self.port}"
                with self._lock:
                    self._declare(
                        {n: f"node {n} ({self.host}) is lost: its store at {where} stopped answering"}
                    )
                address = resolve(self.host)
                if address is not None:  # calls waiting on it (the rendezvous agent's) fail now
                    sever(address)
                return True
            with self._lock:
                self._declare(lost)
        return False

    def _declare(self, lost: dict[int, str]) -> None:
        """Say the lines about the ``lost`` nodes and end this attempt here (under the lock),
        unless a node was named already or this node finished (a store gone after it finished)."""
        if not lost or self.lost or self._finished:
            return
        self.lost = list(lost.values())
        self.lost_nodes |= set(lost)
        for line in self.lost:
            self.report(line)
        self.on_lost()

    def _beat(self, store: Any, now: float) -> dict[int, str]:
        a = self.attempt
        ranks = sorted(b.rank for b in read_beats(self.heartbeats))
        me = {"host": socket.gethostname(), "ranks": ranks, "address": self.address}
        store.set(f"node/{a}/{self.node}", json.dumps(me))
        store.add(f"beat/{a}/{self.node}", 1)
        lines = {}
        for node in range(self.nnodes):  # the nodes of this attempt: those that said who they are
            if node == self.node or not store.check([f"node/{a}/{node}"]):
                continue
            if node not in self.addresses:
                told = json.loads(_get(store, f"node/{a}/{node}", "{}")).get("address")
                if told:
                    self.addresses[node] = str(told)
            if store.check([f"done/{a}/{node}"]):
                self._seen.pop(node, None)
                continue
            count = int(store.add(f"beat/{a}/{node}", 0))
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)
            elif now - last[1] > self.timeout_s:
                lines[node] = self._lost_line(store, node, now - last[1])
        return lines

    def _lost_line(self, store: Any, node: int, silent_s: float) -> str:
        info = json.loads(_get(store, f"node/{self.attempt}/{node}", "{}"))
        where = info.get("host", "?")
        held = _ranks(info.get("ranks", []))
        return (
            f"node {node} ({where}, ranks {held}) is lost: no heartbeat for {silent_s:.0f} s "
            f"(train.watchdog_s = {self.timeout_s:g}); ending this attempt on node {self.node}"
        )


def _within(timeout: float, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, waited for at most ``timeout`` seconds (TimeoutError after
    that): a store whose host vanished without a word (its link down, no reset) leaves a call
    waiting far past the store's own timeout; the thread is left to its socket."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))

    thread = threading.Thread(target=run, name="tessera-node-watch-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        raise TimeoutError(f"no answer within {timeout:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _get(store: Any, key: str, default: str) -> str:
    if not store.check([key]):
        return default
    value: bytes = store.get(key)
    return value.decode()


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "unknown"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
