"""The q x q x q cube of 3D tensor parallelism and its pure shard arithmetic.

A 3D tp group of ``tp = q**3`` ranks is a cube: tp rank ``r = c*q*q + b*q + a``
(``tessera.comm.Topology(tp_mode="3d")``). Three groups of q ranks pass through each rank,
each a line through the cube: ``tp_input`` varies a, ``tp_weight`` varies b, ``tp_output``
varies c; a rank's index in each is its a, b or c.

``CubeShardSpec`` says how one serial tensor maps to every rank's shard and back: each dim
may be cut by one or more cube axes, major first (``"ab"``: q*q chunks, chunk ``a*q + b``);
an axis that cuts no dim replicates the tensor along it (``unshard`` takes the copy at 0).
It is a ``ShardSpec`` (``parallelize`` records it; consolidation all-gathers the equal-shaped
shards over tp along ``local_dim`` and hands them to ``unshard`` in tp-rank order).
Everything here except ``Cube3D``'s groups is integer arithmetic, property-tested without ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from tessera.comm import Group, Mesh, TPGrid, TPMode
from tessera.tensor_parallel.partition import ShardSpec

__all__ = ["AXES", "Cube3D", "CubeShardSpec", "check_cube_divisible", "cube_coords", "cube_side"]

AXES = "abc"  # a: tp_input, b: tp_weight, c: tp_output


def cube_side(tp: int, *, where: str = "3d tensor parallelism") -> int:
    """The side q of a q x q x q cube of ``tp`` ranks (``TPGrid``); ValueError naming tp unless
    it is a cube."""
    return TPGrid.of(TPMode.THREE_D, tp, where=where).side


def check_cube_divisible(size: int, n: int, *, what: str, where: str) -> None:
    """ValueError naming ``where``, ``what`` and both numbers unless ``n`` (q, q^2, q^3) divides it."""
    if size % n:
        raise ValueError(f"{where}: {what}={size} is not divisible by {n} (3d cube)")


def cube_coords(rank: int, q: int) -> dict[str, int]:
    """The cube coordinates ``{"a", "b", "c"}`` of tp rank ``rank = c*q*q + b*q + a``."""
    c, rest = divmod(rank, q * q)
    b, a = divmod(rest, q)
    return {"a": a, "b": b, "c": c}


@dataclass(frozen=True, slots=True)
class Cube3D:
    """This rank's place (a, b, c) in the cube and its three lines: ``input`` (varies a),
    ``weight`` (varies b) and ``output`` (varies c)."""

    q: int
    a: int
    b: int
    c: int
    input: Group
    weight: Group
    output: Group

    def __post_init__(self) -> None:
        if self.q < 1 or not all(0 <= v < self.q for v in (self.a, self.b, self.c)):
            raise ValueError(f"invalid cube position ({self.a}, {self.b}, {self.c}) for q={self.q}")

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> Cube3D:
        """The cube of ``mesh``'s tp group; ValueError unless its topology has tp_mode 3d."""
        topo = mesh.topology
        if topo.tp_mode is not TPMode.THREE_D:
            raise ValueError(
                f"3d layers need a Topology with tp_mode='3d' (tp = q**3); got tp={topo.tp} "
                f"tp_mode={topo.tp_mode.value}"
            )
        q = mesh.size("tp_input")
        a, b, c = (mesh.coordinate(n) for n in ("tp_input", "tp_weight", "tp_output"))
        return cls(q, a, b, c, mesh.group("tp_input"), mesh.group("tp_weight"), mesh.group("tp_output"))

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tp group: ``c*q*q + b*q + a``."""
        return (self.c * self.q + self.b) * self.q + self.a

    def coord(self, axis: str) -> int:
        """This rank's coordinate along cube axis ``"a"``, ``"b"`` or ``"c"``."""
        return {"a": self.a, "b": self.b, "c": self.c}[axis]

    def group(self, axis: str) -> Group:
        """The line through this rank along cube axis ``"a"``, ``"b"`` or ``"c"``."""
        return {"a": self.input, "b": self.weight, "c": self.output}[axis]


@dataclass(frozen=True, slots=True)
class CubeShardSpec(ShardSpec):
    """How a serial tensor is split over a q x q x q cube: ``split[d]`` names the cube axes
    that cut dim d, major first (``"cb"``: q*q chunks, rank (a, b, c) holds chunk ``c*q + b``);
    dims past ``split`` are whole, and an axis named nowhere replicates the tensor.

    ``dim`` (the base field) is 0: shards have equal shapes and consolidation may stack them
    along ``local_dim``.

    >>> CubeShardSpec(split=("ab", "c"))  # nn.Linear weight (out, in): out chunk a*q+b, in block c
    """

    dim: int = 0
    split: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = "".join(self.split)
        if (
            self.sections != 1
            or self.transposed
            or self.dim != 0
            or not set(named) <= set(AXES)
            or len(set(named)) != len(named)
        ):
            raise ValueError(
                f"invalid {self!r}: split names each of a, b, c at most once; no sections or dim"
            )

    @property
    def local_dim(self) -> int:
        """The dim along which equal-shaped shards may be stacked for a gather (always 0)."""
        return 0

    @property
    def replicated(self) -> str:
        """The cube axes along which the tensor is replicated (named in no dim)."""
        return "".join(x for x in AXES if x not in "".join(self.split))

    def replicas(self, tp: int) -> int:
        """``q`` per cube axis the tensor is replicated along (named in no dim)."""
        q = cube_side(tp, where=f"{self}")
        return int(q ** len(self.replicated))

    def __str__(self) -> str:
        cuts = ", ".join(f"dim{d} by {axes}" for d, axes in enumerate(self.split) if axes)
        copies = f", replicated over {self.replicated}" if self.replicated else ""
        return f"cube split ({cuts or 'whole'}{copies})"

    def _index(self, axes: str, coords: dict[str, int], q: int) -> int:
        index = 0
        for x in axes:
            index = index * q + coords[x]
        return index

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        """Rank ``rank``'s shard (tp rank ``c*q*q + b*q + a``) of the serial tensor ``full``."""
        where = f"shard {tuple(full.shape)} along {self}"
        q = cube_side(tp, where=where)
        if not 0 <= rank < tp:
            raise ValueError(f"{where}: rank {rank} is outside [0, {tp})")
        if len(self.split) > full.dim():
            raise ValueError(f"{where}: the tensor has only {full.dim()} dims")
        coords = cube_coords(rank, q)
        out = full
        for d, axes in enumerate(self.split):
            if axes:
                n = q ** len(axes)
                check_cube_divisible(int(full.shape[d]), n, what=f"size of dim {d}", where=where)
                out = out.chunk(n, d)[self._index(axes, coords, q)]
        return out

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """The serial tensor from every rank's shard in tp-rank order (inverse of ``shard``;
        of replicas, the copy at coordinate 0 of each replicated axis)."""
        q = cube_side(len(shards), where=f"unshard along {self}")
        first = shards[0]
        shape = [
            s * (q ** len(self.split[d]) if d < len(self.split) else 1) for d, s in enumerate(first.shape)
        ]
        full = first.new_empty(shape)
        for rank, part in enumerate(shards):
            coords = cube_coords(rank, q)
            if any(coords[x] for x in self.replicated):
                continue
            index: list[slice] = []
            for d, size in enumerate(first.shape):
                k = self._index(self.split[d], coords, q) if d < len(self.split) else 0
                index.append(slice(k * size, (k + 1) * size))
            full[tuple(index)] = part
        return full.contiguous()
