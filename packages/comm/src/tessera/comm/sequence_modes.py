"""The names of context parallelism's two choices, importable without torch.

``Mode``: how attention sees the whole sequence over the ``cp`` axis (K/V passed around a
ring, or an all-to-all from sequence shards to head shards). ``Layout``: which positions each
``cp`` rank holds (contiguous chunks, or the zigzag pairs that balance causal attention).
``sequence_chunks``: the rule for how many equal chunks a sequence is cut into.
``tessera.tensor_parallel.context`` implements both modes and both layouts and exports these
three names; they are defined here so that a launcher or a planner can check a configuration
before torch loads.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Layout", "Mode", "sequence_chunks"]


class Mode(StrEnum):
    """How attention sees the whole sequence: K/V around a ring, or all-to-all to heads."""

    RING = "ring"
    ULYSSES = "ulysses"


class Layout(StrEnum):
    """How a sequence is cut across the ranks of the ``cp`` axis."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"


def sequence_chunks(
    cp: int, layout: Layout | str = Layout.CONTIGUOUS, *, tp: int = 1, sequence_parallel: bool = False
) -> int:
    """How many equal chunks a sequence is cut into: ``cp`` (contiguous) or ``2*cp`` (zigzag)
    over the context-parallel ranks, each cut again into ``tp`` with Megatron sequence
    parallelism. A sequence length must be a multiple of it; ValueError naming cp and tp
    unless both are positive."""
    if cp < 1 or tp < 1:
        raise ValueError(f"sequence_chunks needs cp >= 1 and tp >= 1, got cp={cp}, tp={tp}")
    pieces = 2 if Layout(layout) is Layout.ZIGZAG else 1
    return cp * pieces * (tp if sequence_parallel else 1)
