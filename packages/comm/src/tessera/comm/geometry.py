"""The geometry of a tensor-parallel group: its grid side, its depth and what follows from them.

Pure integer arithmetic, the one place where a tp degree becomes a grid:

- 1d: ``tp`` ranks in one line; a layer's widths split ``tp`` ways, a microbatch's rows not at all.
- 2d (SUMMA), ``tp = q*q``: widths split q ways (the columns), rows in q blocks (the rows).
- 2.5d (Tesseract), ``tp = q*q*depth``: widths split q ways, rows in ``q*depth`` blocks.
- 3d, ``tp = q**3``: widths split q ways, rows in ``q*q`` blocks.

>>> g = TPGrid.of("2.5d", 8, depth=2)
>>> g.side, g.width_split, g.row_blocks, g.line_axis().value
(2, 2, 4, 'tp_row')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.comm.axes import Axis, TPMode

__all__ = ["TPGrid", "integer_root"]


def integer_root(n: int, k: int) -> int | None:
    """The integer r >= 1 with ``r**k == n``, or None (also for n < 1); k must be >= 1."""
    if k < 1:
        raise ValueError(f"integer_root needs a power k >= 1, got k={k}")
    if n < 1:
        return None
    r: int = round(float(n) ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c >= 1 and c**k == n:
            return c
    return None


# one line of the grid, per mode
_LINE: dict[TPMode, Axis] = {
    TPMode.ONE_D: Axis.TP,
    TPMode.TWO_D: Axis.TP_ROW,
    TPMode.TWO_P5_D: Axis.TP_ROW,
    TPMode.THREE_D: Axis.TP_INPUT,
}


def _side(mode: TPMode, tp: int, depth: int) -> int:
    """q of a valid grid; ValueError naming tp, depth and the mode otherwise."""
    said = f"(tp_mode {mode.value}, tp={tp}, depth={depth})"
    if mode is not TPMode.TWO_P5_D and depth != 1:
        raise ValueError(f"depth={depth} is only meaningful for tp_mode 2.5d, not {mode.value} {said}")
    if mode is TPMode.ONE_D:
        return tp
    if mode is TPMode.TWO_D:
        q = integer_root(tp, 2)
        if q is None:
            raise ValueError(f"tp={tp} is not a square q*q: tp_mode 2d needs a q x q grid {said}")
        return q
    if mode is TPMode.THREE_D:
        q = integer_root(tp, 3)
        if q is None:
            raise ValueError(f"tp={tp} is not a cube q*q*q: tp_mode 3d needs a q x q x q cube {said}")
        return q
    if tp % depth:
        raise ValueError(f"tp={tp} is not q*q*depth: depth={depth} does not divide it {said}")
    q = integer_root(tp // depth, 2)
    if q is None:
        raise ValueError(f"tp={tp} is not q*q*depth: tp/depth = {tp // depth} is not a square {said}")
    return q


@dataclass(frozen=True, slots=True)
class TPGrid:
    """A validated tensor-parallel grid: ``mode``, the degree ``tp`` and the 2.5d ``depth``
    (1 for every other mode). Build it with ``TPGrid.of``, which also takes the mode's name."""

    mode: TPMode
    tp: int
    depth: int = 1
    _q: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mode = _mode(self.mode, self.tp, self.depth)
        object.__setattr__(self, "_q", _side(mode, self.tp, self.depth))
        object.__setattr__(self, "mode", mode)

    @classmethod
    def of(cls, mode: TPMode | str, tp: int, depth: int = 1, *, where: str = "") -> TPGrid:
        """The grid of ``tp`` ranks in ``mode`` at ``depth``; ValueError naming tp, depth, the
        mode (and ``where``, prefixed) when they do not make one."""
        try:
            return cls(_mode(mode, tp, depth), tp, depth)
        except ValueError as e:
            if not where:
                raise
            raise ValueError(f"{where}: {e}") from None

    @property
    def side(self) -> int:
        """q: the side of the grid (2d q*q, 2.5d q*q*depth, 3d q**3); tp itself for 1d."""
        return self._q

    @property
    def width_split(self) -> int:
        """How many ways a layer's heads, widths and vocabulary split: tp for 1d, q otherwise."""
        return self._q

    @property
    def row_blocks(self) -> int:
        """How many blocks a microbatch's rows split into: 1 (1d), q (2d), q*depth (2.5d), q*q (3d)."""
        if self.mode is TPMode.ONE_D:
            return 1
        if self.mode is TPMode.TWO_D:
            return self._q
        if self.mode is TPMode.TWO_P5_D:
            return self._q * self.depth
        return self._q * self._q

    def line_axis(self) -> Axis:
        """The axis whose group is one line of the grid (``side`` ranks): tp (1d), tp_row
        (2d, 2.5d), tp_input (3d)."""
        return _LINE[self.mode]


def _mode(mode: TPMode | str, tp: int, depth: int) -> TPMode:
    """``mode`` as a TPMode once tp and depth are positive integers; ValueError naming all three."""
    for name, value in (("tp", tp), ("depth", depth)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{name} must be a positive integer, got tp={tp!r}, depth={depth!r} (tp_mode {mode!s})"
            )
    try:
        return TPMode(mode)
    except ValueError:
        modes = ", ".join(m.value for m in TPMode)
        raise ValueError(f"tp_mode must be one of {modes}; got {mode!r} (tp={tp}, depth={depth})") from None
