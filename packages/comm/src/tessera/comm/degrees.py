"""The degrees of a job, one name each: the fields that the launcher's ``[parallel]`` section,
the planner's `Layout` and the process layout `Topology` all are (each is a `Degrees` with more).

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

__all__ = ["DEGREE_NAMES", "Degrees"]


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
