"""Where a boosted rank's parameters sit in the user's serial model, and what a boosted
model offers to the code that saves and gathers it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from tessera.comm import Mesh
from tessera.tensor_parallel import ShardSpec
from tessera.zero import ZeroOptimizer

__all__ = ["Boosted", "Placement"]


@dataclass(frozen=True)
class Placement:
    """The serial name and shape of every local parameter, how tensor parallelism split it,
    and the pipeline's stage owners.

    ``shard_specs`` maps the serial name of each parameter split over tp to its
    ``ShardSpec`` (what ``parallelize`` recorded); every other parameter is whole on each tp
    rank. ``replicated`` maps each parameter held identically by all tp ranks (a norm not
    split by tensor parallelism) to tp, so that norms count it once. ``experts`` maps the
    serial name of every expert bank split over the ep group to the experts this rank holds,
    ``(start, stop)`` along its first dimension (empty without expert parallelism); its tp
    split, if any, is of that slice.
    """

    names: dict[nn.Parameter, str]  # serial name of each local parameter
    full_shapes: dict[str, tuple[int, ...]]  # serial shape of every parameter
    replicated: dict[nn.Parameter, int]  # parameters identical on tp ranks -> tp
    shard_specs: dict[str, ShardSpec] = field(default_factory=dict)  # serial name -> tp split
    stage_to_rank: tuple[int, ...] = field(default=())  # pipeline: rank of every stage
    experts: dict[str, tuple[int, int]] = field(default_factory=dict)  # serial name -> ep slice


class Boosted(Protocol):
    """What checkpoints and consolidation read from a boosted model (an ``Engine`` is one)."""

    @property
    def mesh(self) -> Mesh: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def zero(self) -> ZeroOptimizer: ...
    @property
    def placement(self) -> Placement: ...
