"""The names of context parallelism's two choices, importable without torch.

``Mode``: how attention sees the whole sequence over the ``sp`` axis (K/V passed around a
ring, or an all-to-all from sequence shards to head shards). ``Layout``: which positions each
``sp`` rank holds (contiguous chunks, or the zigzag pairs that balance causal attention).
``tessera.tensor_parallel.context`` implements both and exports these two enums; they are
defined here so that a launcher can check a configuration naming them before torch loads.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Layout", "Mode"]


class Mode(StrEnum):
    """How attention sees the whole sequence: K/V around a ring, or all-to-all to heads."""

    RING = "ring"
    ULYSSES = "ulysses"


class Layout(StrEnum):
    """How a sequence is cut across the ranks of the ``sp`` axis."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
