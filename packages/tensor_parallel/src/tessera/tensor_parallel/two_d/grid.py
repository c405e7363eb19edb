"""The q x q grid of 2D tensor parallelism (SUMMA / Optimus) and its pure shard arithmetic.

A 2D tp group of ``tp = q*q`` ranks is a grid: tp rank ``r = i*q + j`` sits at row ``i``,
column ``j`` (``tessera.comm.Topology(tp_mode="2d")``). Its ``tp_row`` group holds the q
ranks of row i (its index there is j), its ``tp_col`` group the q ranks of column j (its
index there is i). Activations are split on the batch over the rows (rank (i, j) holds batch
block i) and on the hidden over the columns (hidden block j), as in Optimus / Colossal-AI.

``GridShardSpec`` says how one serial tensor maps to every rank's shard and back; it is a
``ShardSpec`` (so ``parallelize`` records it and consolidation calls its ``shard`` /
``unshard``), but splits over both grid coordinates. Everything here except ``Grid2D``'s
groups is integer arithmetic, property-tested without ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tessera.comm import Group, Mesh, TPGrid, TPMode
from tessera.tensor_parallel.partition import ShardSpec

__all__ = ["Grid2D", "GridShardSpec", "check_grid_divisible", "grid_side"]


def grid_side(tp: int, *, where: str = "2d tensor parallelism") -> int:
    """The side q of a q x q grid of ``tp`` ranks (``TPGrid``); ValueError naming tp unless it
    is a square."""
    return TPGrid.of(TPMode.TWO_D, tp, where=where).side


def check_grid_divisible(size: int, n: int, *, what: str, where: str) -> None:
    """ValueError naming ``where``, ``what`` and both numbers unless ``n`` (q or q*q) divides ``size``."""
    if size % n:
        raise ValueError(f"{where}: {what}={size} is not divisible by {n} (2d grid)")


@dataclass(frozen=True, slots=True)
class Grid2D:
    """This rank's place in the q x q grid and its two groups: ``row`` (the ranks of row i,
    indexed by column j) and ``col`` (the ranks of column j, indexed by row i)."""

    q: int
    i: int
    j: int
    row: Group
    col: Group

    def __post_init__(self) -> None:
        if self.q < 1 or not (0 <= self.i < self.q and 0 <= self.j < self.q):
            raise ValueError(f"invalid grid position ({self.i}, {self.j}) for q={self.q}")

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> Grid2D:
        """The grid of ``mesh``'s tp group; ValueError unless its topology has tp_mode 2d."""
        topo = mesh.topology
        if topo.tp_mode is not TPMode.TWO_D:
            raise ValueError(
                f"2d layers need a Topology with tp_mode='2d' (tp = q*q); got tp={topo.tp} "
                f"tp_mode={topo.tp_mode.value}"
            )
        q = mesh.size("tp_row")
        i, j = mesh.coordinate("tp_col"), mesh.coordinate("tp_row")
        return cls(q, i, j, mesh.group("tp_row"), mesh.group("tp_col"))

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tp group: ``i*q + j``."""
        return self.i * self.q + self.j


@dataclass(frozen=True, slots=True)
class GridShardSpec(ShardSpec):
    """How a serial tensor is split over a q x q grid: rank (i, j) (tp rank ``i*q + j``) holds
    chunk i of dim ``i_dim`` and chunk j of dim ``j_dim``. When both name the same dim, that
    dim is cut into q*q chunks and the rank holds chunk ``j*q + i`` (block j of q, then its
    sub-block i: a bias or norm weight sharded over the whole grid and all-gathered along
    the column). ``dim`` (the base field) is 0: consolidation may all-gather the equal-shaped
    shards along ``local_dim`` and hand them to ``unshard`` in tp rank order.

    >>> GridShardSpec(i_dim=1, j_dim=0)  # nn.Linear weight (out, in): out block j, in block i
    """

    dim: int = 0
    i_dim: int = 0
    j_dim: int = 0

    def __post_init__(self) -> None:
        if self.i_dim < 0 or self.j_dim < 0 or self.sections != 1 or self.transposed or self.dim != 0:
            raise ValueError(f"invalid {self!r}: i_dim, j_dim >= 0; no sections, transposition or dim")

    @property
    def local_dim(self) -> int:
        """The dim along which equal-shaped shards may be stacked for a gather (always 0)."""
        return 0

    def __str__(self) -> str:
        if self.i_dim == self.j_dim:
            return f"dim{self.i_dim} in q*q chunks (chunk j*q+i)"
        return f"dim{self.i_dim} over rows i, dim{self.j_dim} over columns j"

    def _check(self, shape: Sequence[int], q: int) -> None:
        where = f"shard {tuple(shape)} along {self}"
        for d in {self.i_dim, self.j_dim}:
            if d >= len(shape):
                raise ValueError(f"{where}: the tensor has no dim {d}")
        if self.i_dim == self.j_dim:
            check_grid_divisible(shape[self.i_dim], q * q, what=f"size of dim {self.i_dim}", where=where)
        else:
            check_grid_divisible(shape[self.i_dim], q, what=f"size of dim {self.i_dim}", where=where)
            check_grid_divisible(shape[self.j_dim], q, what=f"size of dim {self.j_dim}", where=where)

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        """Rank ``rank``'s shard (tp rank ``i*q + j``) of the serial tensor ``full`` over ``tp = q*q``."""
        q = grid_side(tp, where=f"shard along {self}")
        if not 0 <= rank < tp:
            raise ValueError(f"shard along {self}: rank {rank} is outside [0, {tp})")
        self._check(full.shape, q)
        i, j = divmod(rank, q)
        if self.i_dim == self.j_dim:
            return full.chunk(q * q, self.i_dim)[j * q + i]
        return full.chunk(q, self.i_dim)[i].chunk(q, self.j_dim)[j]

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """The serial tensor from every rank's shard, in tp rank order (inverse of ``shard``)."""
        q = grid_side(len(shards), where=f"unshard along {self}")
        if self.i_dim == self.j_dim:
            ordered = [shards[i * q + j] for j in range(q) for i in range(q)]
            return torch.cat(ordered, self.i_dim).contiguous()
        rows = [torch.cat([shards[i * q + j] for j in range(q)], self.j_dim) for i in range(q)]
        return torch.cat(rows, self.i_dim).contiguous()
