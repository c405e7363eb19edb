"""The parallel layout of a job: degrees, rank <-> coordinates, and the rank groups of every axis.

Everything here is pure arithmetic over integers: no process group is touched.

Ranks are laid out in the order (pp, dp, cp, tp) from slowest to fastest varying, so the
ranks of one tensor-parallel group are contiguous (one node keeps its TP traffic).

Expert parallelism subdivides the data-parallel ranks: ``ep`` divides dp, and the dp
coordinate is ``e * ep + p``. The ``ep`` consecutive dp coordinates with the same ``e`` form
one expert-parallel group (``ep``: they split the experts between them, index ``p``); the
``dp / ep`` ranks with the same ``p`` form the expert-data-parallel group (``edp``: they hold
the same experts, index ``e``). Both axes exist only when ep > 1. Tensor
parallelism of mode 2d, 2.5d and 3d decomposes the tp coordinate further:

- 2d (SUMMA), tp = q*q: tp = i*q + j. ``tp_row`` holds the ranks of one row (same i,
  varying j); ``tp_col`` the ranks of one column (same j, varying i). As in Colossal-AI, a
  rank's index in its ``tp_row`` group is its column j and in its ``tp_col`` group its row i.
- 2.5d (Tesseract), tp = q*q*d: tp = k*q*q + i*q + j with depth index k; ``tp_row`` and
  ``tp_col`` as in 2d inside one layer of depth, ``tp_dep`` the d ranks with the same (i, j).
- 3d, tp = q**3: tp = c*q*q + b*q + a; ``tp_input`` varies a, ``tp_weight`` varies b and
  ``tp_output`` varies c (each a line through the cube).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tessera.comm.axes import Axis, TPMode
from tessera.comm.degrees import Degrees
from tessera.comm.geometry import TPGrid

__all__ = ["Axis", "Degrees", "TPMode", "Topology"]


# The sub-axes of each tp mode, as (axis, atom) pairs, atoms listed slowest first.
_TP_ATOMS: dict[TPMode, tuple[tuple[str, Axis | None], ...]] = {
    TPMode.ONE_D: (("tp", None),),
    TPMode.TWO_D: (("tp.i", Axis.TP_COL), ("tp.j", Axis.TP_ROW)),
    TPMode.TWO_P5_D: (("tp.k", Axis.TP_DEP), ("tp.i", Axis.TP_COL), ("tp.j", Axis.TP_ROW)),
    TPMode.THREE_D: (("tp.c", Axis.TP_OUTPUT), ("tp.b", Axis.TP_WEIGHT), ("tp.a", Axis.TP_INPUT)),
}


@dataclass(frozen=True, slots=True)
class Topology(Degrees):
    """An immutable, validated description of the degrees of a job.

    ``world_size = pp * dp * cp * tp``. ``tp_depth`` is the 2.5d depth d (tp = q*q*d) and must
    be 1 for every other mode. ``ep`` (expert parallelism) must divide ``dp``; with ep > 1
    the topology has the ``ep`` and ``edp`` axes (module docstring).

    >>> t = Topology(dp=2, tp=4, tp_mode="2d")
    >>> t.world_size, t.groups("tp_row")[:2]
    (8, ((0, 1), (2, 3)))
    """

    _grid: TPGrid = field(init=False, repr=False, compare=False)
    _atoms: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "cp", "tp_depth", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(
                f"Topology.ep ({self.ep}) must divide dp ({self.dp}): the expert-parallel ranks are "
                "data-parallel ranks"
            )
        grid = TPGrid.of(self.tp_mode, self.tp, self.tp_depth)
        object.__setattr__(self, "tp_mode", grid.mode)
        object.__setattr__(self, "_grid", grid)
        object.__setattr__(self, "_atoms", self._layout(grid))

    @property
    def grid(self) -> TPGrid:
        """The tensor-parallel grid of this topology (its side, depth, splits and line axis)."""
        return self._grid

    def _layout(self, grid: TPGrid) -> tuple[tuple[str, int], ...]:
        q, depth = grid.side, grid.depth
        sizes = {
            TPMode.ONE_D: (q,),
            TPMode.TWO_D: (q, q),
            TPMode.TWO_P5_D: (depth, q, q),
            TPMode.THREE_D: (q, q, q),
        }[grid.mode]
        names = (name for name, _ in _TP_ATOMS[grid.mode])
        tp_atoms = tuple(zip(names, sizes, strict=True))
        dp_atoms = (("dp.e", self.dp // self.ep), ("dp.p", self.ep))
        return (("pp", self.pp), *dp_atoms, ("cp", self.cp), *tp_atoms)

    # ----------------------------------------------------------------------------- queries
    @property
    def axes(self) -> tuple[Axis, ...]:
        """The axes this topology has groups for (tp sub-axes only for the modes that have them)."""
        subs = tuple(a for _, a in _TP_ATOMS[self.tp_mode] if a is not None)
        experts = (Axis.EP, Axis.EDP) if self.ep > 1 else ()
        return (Axis.PP, Axis.DP, Axis.CP, Axis.TP, *subs, *experts)

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless ``world_size`` is exactly what the degrees multiply to."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*{self.tp}"
                f" = {self.world_size}"
            )

    def _atoms_of(self, axes: Axis | str | Iterable[Axis | str]) -> list[int]:
        names = [axes] if isinstance(axes, str) else list(axes)
        chosen: set[str] = set()
        for raw in names:
            try:
                axis = Axis(raw)
            except ValueError:
                raise ValueError(f"unknown axis {raw!r}; known: {[a.value for a in Axis]}") from None
            if axis in (Axis.EP, Axis.EDP) and self.ep == 1:
                raise ValueError(f"axis {axis.value!r} exists only with expert parallelism (ep > 1), ep is 1")
            if axis not in self.axes:
                raise ValueError(f"axis {axis.value!r} does not exist for tp_mode {self.tp_mode.value}")
            if axis is Axis.TP:
                chosen.update(n for n, _ in self._atoms if n.startswith("tp"))
            elif axis is Axis.DP:
                chosen.update(("dp.e", "dp.p"))
            elif axis is Axis.EP:
                chosen.add("dp.p")
            elif axis is Axis.EDP:
                chosen.add("dp.e")
            elif axis.value.startswith("tp_"):
                chosen.update(n for n, a in _TP_ATOMS[self.tp_mode] if a is axis)
            else:
                chosen.add(axis.value)
        return [i for i, (n, _) in enumerate(self._atoms) if n in chosen]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")

    def _digits(self, rank: int) -> list[int]:
        self._check_rank(rank)
        digits = []
        for _, size in reversed(self._atoms):
            rank, d = divmod(rank, size)
            digits.append(d)
        return digits[::-1]

    def _compose(self, digits: list[int], idx: list[int]) -> int:
        value = 0
        for i in idx:
            value = value * self._atoms[i][1] + digits[i]
        return value

    def size(self, axes: Axis | str | Iterable[Axis | str]) -> int:
        """The number of ranks in one group of ``axes`` (one axis or several combined)."""
        return math.prod(self._atoms[i][1] for i in self._atoms_of(axes))

    def coordinate(self, rank: int, axes: Axis | str | Iterable[Axis | str]) -> int:
        """The index of ``rank`` inside its group of ``axes``."""
        return self._compose(self._digits(rank), self._atoms_of(axes))

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """The index of ``rank`` inside its group of every axis."""
        digits = self._digits(rank)
        return {a: self._compose(digits, self._atoms_of(a)) for a in self.axes}

    def rank(self, coords: Mapping[Axis | str, int]) -> int:
        """The rank at ``coords`` (pp, dp, cp, tp; missing ones are 0): inverse of coordinates."""
        unknown = set(map(str, coords)) - {"pp", "dp", "cp", "tp"}
        if unknown:
            raise ValueError(f"rank() takes pp, dp, cp and tp coordinates, not {sorted(unknown)}")
        value = 0
        for name in ("pp", "dp", "cp", "tp"):
            c, n = coords.get(name, 0), getattr(self, name)
            if not 0 <= c < n:
                raise ValueError(f"{name} coordinate {c} is outside [0, {n})")
            value = value * n + c
        return value

    def groups(self, axes: Axis | str | Iterable[Axis | str]) -> tuple[tuple[int, ...], ...]:
        """Every group of ``axes``: ranks that differ only along those axes, in coordinate order.

        The groups of any axis partition the world; they are ordered by their smallest rank.
        """
        varying = self._atoms_of(axes)
        fixed = [i for i in range(len(self._atoms)) if i not in varying]
        out = []
        for fixed_digits in itertools.product(*(range(self._atoms[i][1]) for i in fixed)):
            group = []
            for var_digits in itertools.product(*(range(self._atoms[i][1]) for i in varying)):
                digits = [0] * len(self._atoms)
                for i, d in zip(fixed, fixed_digits, strict=True):
                    digits[i] = d
                for i, d in zip(varying, var_digits, strict=True):
                    digits[i] = d
                group.append(self._compose(digits, list(range(len(self._atoms)))))
            out.append(tuple(group))
        return tuple(sorted(out))

    def group_of(self, rank: int, axes: Axis | str | Iterable[Axis | str]) -> tuple[int, ...]:
        """The group of ``axes`` that holds ``rank``."""
        digits = self._digits(rank)
        varying = self._atoms_of(axes)
        group = []
        for var_digits in itertools.product(*(range(self._atoms[i][1]) for i in varying)):
            d = list(digits)
            for i, v in zip(varying, var_digits, strict=True):
                d[i] = v
            group.append(self._compose(d, list(range(len(self._atoms)))))
        return tuple(group)

    def describe(self) -> str:
        """One line naming the degrees, e.g. ``pp=2 dp=2 cp=1 tp=4 (2d)`` (and ``ep=2`` after dp
        under expert parallelism)."""
        extra = f", tp_depth={self.tp_depth}" if self.tp_mode is TPMode.TWO_P5_D else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"pp={self.pp} dp={self.dp}{ep} cp={self.cp} tp={self.tp} ({self.tp_mode.value}{extra})"
