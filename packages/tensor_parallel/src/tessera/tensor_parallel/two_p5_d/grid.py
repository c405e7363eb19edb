"""The q x q x d grid of 2.5D tensor parallelism (Tesseract) and its pure shard arithmetic.

A 2.5D tp group of ``tp = q*q*d`` ranks is d depth layers of a q x q 2D grid: tp rank
``r = k*q*q + i*q + j`` sits at depth ``k``, row ``i``, column ``j``
(``tessera.comm.Topology(tp_mode="2.5d", tp_depth=d)``). Inside one depth layer ``tp_row`` and
``tp_col`` are the 2D grid's groups; ``tp_dep`` holds the d ranks with the same (i, j).

Activations: rank (k, i, j) holds batch block ``k*q + i`` of q*d (depth-major: depth layer k
holds a contiguous 1/d of the batch, cut over its rows) and hidden block j. Weights: split
over (i, j) exactly as in 2D and replicated over k, so each weight gradient is the sum of
the d depth layers' partial gradients (an all-reduce over ``tp_dep``).

``Grid2p5D`` *is* the ``Grid2D`` of this rank's depth layer (every 2D function runs on it
unchanged; its ``tp_rank`` is the index ``i*q + j`` inside the layer) plus the depth.
``DepthShardSpec`` is a 2D ``GridShardSpec`` replicated over the depth. Everything here
except ``Grid2p5D``'s groups is integer arithmetic, property-tested without ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from tessera.comm import Group, Mesh, TPGrid, TPMode
from tessera.tensor_parallel.two_d.grid import Grid2D, GridShardSpec

__all__ = ["DepthShardSpec", "Grid2p5D", "check_batch_2p5d", "tesseract_side"]


def tesseract_side(tp: int, depth: int, *, where: str = "2.5d tensor parallelism") -> int:
    """The side q of a q x q x d grid of ``tp`` ranks at depth ``depth``; ValueError naming
    the numbers unless ``tp = q*q*depth`` (``TPGrid``)."""
    return TPGrid.of(TPMode.TWO_P5_D, tp, depth, where=where).side


def check_batch_2p5d(batch: int, q: int, depth: int, *, where: str) -> None:
    """ValueError naming the numbers unless q*d divides the batch (a block per row and depth)."""
    if batch % (q * depth):
        raise ValueError(
            f"{where}: batch={batch} is not divisible by q*depth = {q}*{depth} = {q * depth} (2.5d grid)"
        )


@dataclass(frozen=True, slots=True)
class Grid2p5D(Grid2D):
    """This rank's depth layer (a ``Grid2D``: ``q``, row ``i``, column ``j``, groups ``row``
    and ``col``) and its place in depth: ``k`` of ``d``, with ``dep`` the d ranks of the same
    (i, j). ``tp_rank`` (inherited) is ``i*q + j``, the index inside the layer;
    ``tesseract_rank`` the index ``k*q*q + i*q + j`` in the whole tp group."""

    d: int = 1
    k: int = 0
    dep: Group = None

    def __post_init__(self) -> None:
        Grid2D.__post_init__(self)
        if self.d < 1 or not 0 <= self.k < self.d:
            raise ValueError(f"invalid depth index k={self.k} for depth d={self.d}")

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> Grid2p5D:
        """The grid of ``mesh``'s tp group; ValueError unless its topology has tp_mode 2.5d."""
        topo = mesh.topology
        if topo.tp_mode is not TPMode.TWO_P5_D:
            raise ValueError(
                f"2.5d layers need a Topology with tp_mode='2.5d' (tp = q*q*depth); got tp={topo.tp} "
                f"tp_mode={topo.tp_mode.value}"
            )
        q = mesh.size("tp_row")
        i, j, k = mesh.coordinate("tp_col"), mesh.coordinate("tp_row"), mesh.coordinate("tp_dep")
        rows, cols, deps = mesh.group("tp_row"), mesh.group("tp_col"), mesh.group("tp_dep")
        return cls(q, i, j, rows, cols, topo.tp_depth, k, deps)

    @property
    def tesseract_rank(self) -> int:
        """This rank's index in its tp group: ``k*q*q + i*q + j``."""
        return self.k * self.q * self.q + self.tp_rank

    @property
    def batch_index(self) -> int:
        """The batch block (of q*d) this rank's activations hold: ``k*q + i``."""
        return self.k * self.q + self.i


@dataclass(frozen=True, slots=True)
class DepthShardSpec(GridShardSpec):
    """A ``GridShardSpec`` (see two_d) over each q x q depth layer, replicated over the d
    layers: tp rank ``k*q*q + i*q + j`` holds what 2D rank ``i*q + j`` holds.

    ``shard`` needs ``depth``. ``unshard`` (one shard per tp rank, in tp rank order, as
    consolidation passes them) keeps depth 0's q*q copies; it finds q from ``depth`` or, when
    the style did not know the depth, from ``shape`` (the serial tensor's, which the style
    records) and the shards' shape, so it is never ambiguous (tp=16 is 2x2x4 or 4x4x1).
    """

    depth: int | None = None
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        GridShardSpec.__post_init__(self)
        if self.depth is None and self.shape is None:
            raise ValueError(f"{self!r}: a depth-replicated spec needs its depth or the serial shape")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"{self!r}: depth must be >= 1")

    def __str__(self) -> str:
        return f"{GridShardSpec.__str__(self)}, replicated over depth {self.depth or '(from the shape)'}"

    def replicas(self, tp: int) -> int:
        """The depth: each depth layer holds a copy of the 2D grid's shards (needs ``depth``)."""
        if self.depth is None:
            raise ValueError(f"{self}: the depth is unknown; bind it (bind_2p5d, plan_for_mode depth=)")
        tesseract_side(tp, self.depth, where=f"{self}")
        return self.depth

    def _side(self, tp: int, chunk: Sequence[int] | None) -> int:
        where = f"{self}"
        if self.depth is not None:
            return tesseract_side(tp, self.depth, where=where)
        assert self.shape is not None and chunk is not None
        d = self.i_dim
        if chunk[d] < 1 or self.shape[d] % chunk[d]:
            raise ValueError(f"{where}: a shard {tuple(chunk)} does not tile the serial {self.shape}")
        ratio = self.shape[d] // chunk[d]
        q = ratio if self.i_dim != self.j_dim else math.isqrt(ratio)
        if q < 1 or tp % (q * q) or (self.i_dim == self.j_dim and q * q != ratio):
            raise ValueError(f"{where}: {tp} shards {tuple(chunk)} do not tile the serial {self.shape}")
        return q

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        """Rank ``rank``'s shard of the serial ``full`` over ``tp = q*q*depth`` (needs ``depth``)."""
        if self.depth is None:
            raise ValueError(f"shard along {self}: the depth is unknown; bind it (bind_2p5d)")
        q = self._side(tp, None)
        if not 0 <= rank < tp:
            raise ValueError(f"shard along {self}: rank {rank} is outside [0, {tp})")
        return GridShardSpec.shard(self, full, rank % (q * q), q * q)

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """The serial tensor from every tp rank's shard in tp rank order: depth 0's copies."""
        if not shards:
            raise ValueError(f"unshard along {self}: no shards")
        q = self._side(len(shards), tuple(shards[0].shape))
        return GridShardSpec.unshard(self, shards[: q * q])
