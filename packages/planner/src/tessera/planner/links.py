"""The link model: seconds a collective takes over ``n`` ranks joined by a link of
``latency`` seconds and ``bandwidth`` bytes/s per rank and direction (alpha-beta model).

``nbytes`` is always the size of the whole tensor the collective is about (an all-gather's
output, a reduce-scatter's input, an all-reduce's buffer). Ring algorithms move ``(n-1)/n``
of it per rank per phase in ``n-1`` steps; the tree all-reduce (NCCL's double binary tree)
pays ``2 log2 n`` latencies and about twice the bytes over the bandwidth; an all-reduce takes
whichever is faster, as NCCL picks by size. An all-to-all follows the ring phase's form over
the link, unless the link carries its own measured all-to-all terms (``a2a_latency``,
``a2a_bandwidth``: gloo's ``all_to_all_single`` on a CPU host costs about as much as an
all-reduce of the same buffer, not half of one; `Cluster` documents the measurement), and a
message follows its own measured terms where the link has them (``p2p_latency``,
``p2p_bandwidth``: on a CPU host messages travel over gloo while collectives go through
shared memory). A ``flat`` link (a node's groups meeting in one shared-memory segment,
`tessera.comm.shm`) takes any collective call in one round whatever the group's size: each
rank writes, meets its peers, reads and meets them again, two latencies per call (an
all-reduce, an all-gather, a broadcast alike), not one per ring step or tree hop (a call
costs about the same CPU time among 2, 4 or 8 ranks there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Link"]


@dataclass(frozen=True, slots=True)
class Link:
    """Latency (s) and bandwidth (bytes/s per rank and direction) of the link a group uses."""

    latency: float
    bandwidth: float
    a2a_latency: float = 0.0  # > 0 with a2a_bandwidth: a measured all-to-all (else the ring form)
    a2a_bandwidth: float = 0.0
    p2p_latency: float = 0.0  # > 0 with p2p_bandwidth: a measured message (else the link's terms)
    p2p_bandwidth: float = 0.0
    flat: bool = False  # one round of two latencies per call (shared memory), not ring steps

    def call(self, hops: float) -> float:
        """The latency of one collective call that takes ``hops`` steps over the link (a
        tree's depth, a ring's length): two latencies on a flat link, whatever the hops."""
        return 2 * self.latency if self.flat else hops * self.latency

    def p2p(self, nbytes: float) -> float:
        """One message between two ranks (over the measured message terms when the link has them)."""
        if self.p2p_bandwidth > 0:
            return self.p2p_latency + nbytes / self.p2p_bandwidth
        return self.latency + nbytes / self.bandwidth

    def ring_phase(self, nbytes: float, n: int) -> float:
        """An all-gather or a reduce-scatter by ring: n-1 steps of nbytes/n each."""
        if n <= 1:
            return 0.0
        return self.call(n - 1) + (n - 1) / n * nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, n: int) -> float:
        """An all-reduce: the faster of ring (reduce-scatter + all-gather) and tree."""
        if n <= 1:
            return 0.0
        if self.flat:  # one call: both phases' bytes, one round
            return self.call(1) + 2 * (n - 1) / n * nbytes / self.bandwidth
        ring = 2 * self.ring_phase(nbytes, n)
        tree = 2 * math.ceil(math.log2(n)) * self.latency + 2 * nbytes / self.bandwidth
        return min(ring, tree)

    def broadcast(self, nbytes: float, n: int) -> float:
        """A broadcast by pipelined tree: log2 n latencies, the bytes once over the bandwidth."""
        if n <= 1:
            return 0.0
        return self.call(math.ceil(math.log2(n))) + nbytes / self.bandwidth

    def all_to_all(self, nbytes: float, n: int) -> float:
        """An all-to-all of a tensor of nbytes per rank: (n-1)/n of it leaves each rank, in n-1
        messages (over the measured all-to-all terms when the link has them)."""
        if n <= 1:
            return 0.0
        if self.a2a_bandwidth > 0:
            return (n - 1) * self.a2a_latency + (n - 1) / n * nbytes / self.a2a_bandwidth
        return self.ring_phase(nbytes, n)
