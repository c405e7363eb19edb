"""The degrees of a job, one name each: the fields that the launcher's ``[parallel]`` section,
the planner's `Layout` and the process layout `Topology` all are (each is a `Degrees` with more);
and `Parallelism`, the degrees with how they run (the schedule, context parallelism's mode),
which the launcher's ``[parallel]`` section and the planner's `Layout` both are.

``dp`` data, ``pp`` pipeline, ``tp`` tensor (``tp_mode`` "1d", "2d", "2.5d" or "3d", and
``tp_depth``, the 2.5D grid's depth), ``cp`` context (the sequence split over ranks; Megatron's
sequence parallelism is not a degree: it reuses the tp ranks) and ``ep`` expert parallelism (over
the data-parallel ranks, so it divides ``dp`` and adds no ranks). Pure integers: nothing here is
validated (`Topology` validates, raising; the launcher's configuration reports every mistake as a
line) and nothing imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tessera.comm.axes import TPMode
from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.comm.sequence_modes import Mode as ContextMode

__all__ = ["DEGREE_NAMES", "PARALLELISM_NAMES", "Degrees", "Parallelism"]


@dataclass(frozen=True, slots=True)
class Degrees:
    """dp x pp x tp x cp ranks, tp's mode and 2.5D depth, and ep inside dp.

    >>> Degrees(dp=2, tp=4, tp_mode=TPMode.TWO_D).world_size
    8
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    tp_mode: TPMode = TPMode.ONE_D
    tp_depth: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        """The number of ranks: dp * pp * tp * cp (ep splits dp's ranks, it adds none)."""
        return self.dp * self.pp * self.tp * self.cp

    def degrees(self) -> Degrees:
        """These degrees alone (a `Topology`, `ParallelConfig` or `Layout` carries more)."""
        return Degrees(**self.degree_values())

    def degree_values(self) -> dict[str, Any]:
        """The degrees by name, to build any other `Degrees` from: ``Topology(**d.degree_values())``."""
        return {name: getattr(self, name) for name in DEGREE_NAMES}


DEGREE_NAMES = tuple(f.name for f in fields(Degrees))
"""The degrees' names, in their order."""


@dataclass(frozen=True, slots=True)
class Parallelism(Degrees):
    """The degrees and how they run. ``cp_mode`` ("ring" or "ulysses") and ``cp_layout``
    ("contiguous" or "zigzag": balances causal attention over the cp ranks) for ``cp`` > 1;
    ``sequence_parallel``: Megatron's sequence parallelism over the tp ranks; ``schedule``: a
    pipeline schedule's name (``tessera.pipeline.SCHEDULES``), ``microbatches`` per step,
    ``virtual_stages`` chunks per pipeline rank for the interleaved schedules, ``tune_splits``: a
    split-backward schedule (zb-h1, zbv) times its first steps split and unsplit, this many
    pairs of steps after a warm-up, then keeps a split only where the simulated step under the
    measured costs gains (``tessera.pipeline.tune``); 0: every split. Nothing here is validated
    (module docstring)."""

    cp_mode: ContextMode = ContextMode.RING
    cp_layout: ContextLayout = ContextLayout.CONTIGUOUS
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    tune_splits: int = 2

    def parallelism_values(self) -> dict[str, Any]:
        """The degrees and how they run, by name, to build any other `Parallelism` from."""
        return {name: getattr(self, name) for name in PARALLELISM_NAMES}


PARALLELISM_NAMES = tuple(f.name for f in fields(Parallelism))
"""The names of `Parallelism`'s fields (the degrees first), in their order."""
