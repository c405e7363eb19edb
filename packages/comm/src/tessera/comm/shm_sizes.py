"""The sizes of the shared-memory transports (`tessera.comm.shm`, `tessera.comm.shm_p2p`),
importable without torch, so that a planner counts the bytes each rank maps from the
numbers the transports use."""

from __future__ import annotations

__all__ = ["LINE_BYTES", "SLOTS_BYTES"]

LINE_BYTES = 64
"""Bytes of one counter of a segment: one per cache line."""

SLOTS_BYTES = 8 << 20
"""Bytes of slots per collective segment (both parities, every rank): slots of 2 MiB on 2 ranks."""
