"""How a trained parameter appears in an export under the model's own names.

``boost()`` may train a parameter under a name and shape of its own: a mixture of experts
converted to ``tessera.moe.MoE`` trains each bank of experts as one stacked tensor
(``experts.w1 [E, d, h]``) where the user's model holds one ``nn.Linear`` per expert
(``experts.<e>.gate_proj.weight [h, d]``) and a Hugging Face one two fused banks
(``experts.gate_up_proj [E, 2h, d]``: gate rows, then up rows; Llama 4's ``[E, d, 2h]``: gate
columns, then up columns; GPT-OSS's the same with gate and up columns alternating). An
`ExportPart` names one exported tensor and how it is taken from the trained parameter's full
value: the slice ``index`` along the first dimension (None: the whole tensor), transposed or
not, and, with ``band``, as a `Band` of an exported tensor that other parameters' parts with
the same name complete (``w1`` and ``w3`` make ``gate_up_proj``): rows or columns
``start:stop:step``.
``legacy`` is the same piece as checkpoints of an older layout hold it (transformers'
one-tensor-per-expert layout, which ``save_pretrained`` still writes): an import reads it where
a file lacks ``name``. A persistent buffer may be renamed the same way (one whole part).

One description serves every direction: ``export`` and ``consolidate`` write the parts as the
parameters stream (`Joiner` holds a piece until its tensor is complete; `export_shapes` lays
the file out beforehand), and `assemble` is the way back (``import_weights``, ``import_dcp``,
and deferred initialization, which makes a parameter from the user's model's own).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

__all__ = [
    "Band",
    "ExportPart",
    "ExportView",
    "Joiner",
    "assemble",
    "export_names",
    "export_shapes",
    "found_parts",
    "parts_of",
    "sliced",
]

Exported = Mapping[str, tuple["ExportPart", ...]]


@dataclass(frozen=True, slots=True)
class Band:
    """The indices ``start:stop:step`` of dimension ``dim`` (-2: rows, -1: columns) of an
    exported tensor that one part holds, the other parts of that tensor holding the rest."""

    dim: int
    start: int
    stop: int
    step: int = 1

    def __post_init__(self) -> None:
        if self.dim not in (-2, -1) or not 0 <= self.start < self.stop or self.step < 1:
            raise ValueError(f"{self} is not a band of rows (dim -2) or columns (dim -1)")

    @property
    def size(self) -> int:
        """How many indices the band holds."""
        return len(range(self.start, self.stop, self.step))

    def cut(self, value: Tensor) -> Tensor:
        """The band of ``value`` (a view)."""
        if self.step == 1:
            return value.narrow(self.dim, self.start, self.size)
        return value.movedim(self.dim, 0)[self.start : self.stop : self.step].movedim(0, self.dim)


@dataclass(frozen=True, slots=True)
class ExportPart:
    """One exported tensor ``name`` (or its `Band` ``band``), taken as ``full[index]`` (or
    ``full``), its last two dimensions swapped when ``transpose``; ``legacy``: the same piece in
    a checkpoint of an older layout; ``view``: the shape a buffer is exported in, where it is
    held in another of the same size (ERNIE's score-correction bias: ``[1, E]`` for ``[E]``);
    ``joined`` (with ``index``): the ``index``-th of the tensors the parameter is concatenated
    from along its first dimension (what transformers joins on load, read by an import only),
    not a slice of a stacked bank."""

    name: str
    index: int | None = None
    transpose: bool = False
    band: Band | None = None
    legacy: tuple[ExportPart, ...] = ()
    view: tuple[int, ...] | None = None
    joined: bool = False

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        """The piece's shape from the trained parameter's full shape."""
        shape = tuple(full[1:]) if self.index is not None else tuple(full)
        return (*shape[:-2], shape[-1], shape[-2]) if self.transpose else shape

    def take(self, full: Tensor) -> Tensor:
        """The piece from the trained parameter's full value (in its ``view``, where it has one)."""
        out = full[self.index] if self.index is not None else full
        out = out.transpose(-2, -1).contiguous() if self.transpose else out
        return out if self.view is None else out.reshape(self.view)

    def fits(self, full: Sequence[int], saved: Sequence[int]) -> bool:
        """Whether a saved tensor shaped ``saved`` holds this piece of a parameter shaped ``full``."""
        if self.joined:  # any share of the first dimension: `assemble` checks they add up
            return len(saved) == len(full) and list(saved[1:]) == list(full[1:]) and not self.transpose
        want, saved = list(self.shape(full)), list(saved)
        band = self.band
        if band is None:
            return saved == want
        if len(saved) != len(want) or len(want) < -band.dim or want[band.dim] != band.size:
            return False
        held = saved[band.dim]
        want[band.dim] = saved[band.dim] = 0
        return held >= band.stop and saved == want

    def piece(self, value: Tensor) -> Tensor:
        """`take` undone but for ``index``: the trained layout of this piece of the exported
        tensor's ``value``."""
        if self.band is not None:
            value = self.band.cut(value)
        return value.transpose(-2, -1) if self.transpose else value


@dataclass(frozen=True, slots=True)
class ExportView:
    """An export of other names than the trained ones: ``exported`` maps a parameter to the
    tensors it exports as (over ``Placement.exported``; the empty tuple leaves it out), and
    ``added`` a parameter to what is added to its full value first (an adapter merged into its
    base layer's weight: ``tessera.launcher.checkpoint.adapter_files``)."""

    exported: Exported
    added: Mapping[str, Tensor]


def parts_of(name: str, exported: Exported) -> tuple[ExportPart, ...]:
    """The parts parameter ``name`` exports as (itself, whole, when ``exported`` lacks it; none
    when ``exported`` maps it to the empty tuple: not exported)."""
    return exported[name] if name in exported else (ExportPart(name),)


def export_names(names: Sequence[str], exported: Exported) -> list[str]:
    """Every exported name of the parameters ``names``, in order, each once."""
    return list(dict.fromkeys(part.name for name in names for part in parts_of(name, exported)))


def _pieces(parts: Sequence[ExportPart]) -> Counter[str]:
    """How many band pieces make each joined tensor."""
    return Counter(p.name for p in parts if p.band is not None)


def export_shapes(shapes: Mapping[str, Sequence[int]], exported: Exported) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the parameters ``shapes`` (name -> full shape, in streaming
    order) export as, in the order a `Joiner` gives them (a joined one where its last piece
    comes); ValueError naming a joined tensor whose pieces' bands do not tile it."""
    out: dict[str, tuple[int, ...]] = {}
    pieces = _pieces([p for name in shapes for p in parts_of(name, exported)])
    held: dict[str, list[tuple[ExportPart, tuple[int, ...]]]] = {}
    for name, full in shapes.items():
        for part in parts_of(name, exported):
            if part.band is None:
                out[part.name] = part.shape(full)
                continue
            got = held.setdefault(part.name, [])
            got.append((part, part.shape(full)))
            if len(got) == pieces[part.name]:
                out[part.name] = _joined_shape(part.name, held.pop(part.name))
    return out


def _joined_shape(name: str, got: list[tuple[ExportPart, tuple[int, ...]]]) -> tuple[int, ...]:
    bands = [p.band for p, _ in got if p.band is not None]
    dim, first = bands[0].dim, list(got[0][1])
    indices = sorted(i for b in bands for i in range(b.start, b.stop, b.step))
    others = {(*s[:dim], *s[dim:][1:]) for _, s in got}  # every dimension but the band's
    fit = len(others) == 1 and all(p.band is not None and s[p.band.dim] == p.band.size for p, s in got)
    if {b.dim for b in bands} != {dim} or indices != list(range(len(indices))) or not fit:
        raise ValueError(f"the pieces of {name} (bands {bands}) do not tile it")
    first[dim] = len(indices)
    return tuple(first)


class Joiner:
    """The exported tensors as the parameters' parts stream past (``add``): a whole one at
    once, one joined from band pieces when its last piece comes (the others held until then)."""

    def __init__(self, exported: Exported, names: Sequence[str]) -> None:
        self._pieces = _pieces([p for name in names for p in parts_of(name, exported)])
        self._held: dict[str, list[tuple[Band, Tensor]]] = {}

    def add(self, part: ExportPart, piece: Tensor) -> Tensor | None:
        """``part``'s exported tensor when ``piece`` completes it, else None."""
        if part.band is None:
            return piece
        held = self._held.setdefault(part.name, [])
        held.append((part.band, piece))
        if len(held) < self._pieces[part.name]:
            return None
        del self._held[part.name]
        dim = part.band.dim
        shape = list(piece.shape)
        shape[dim] = sum(band.size for band, _ in held)
        out = piece.new_empty(shape)
        for band, value in held:
            band.cut(out).copy_(value)
        return out


def found_parts(parts: tuple[ExportPart, ...], holds: Callable[[str], bool]) -> tuple[ExportPart, ...] | None:
    """The parts a checkpoint holding the names ``holds`` says yes to gives a parameter: its
    exported parts, else their ``legacy`` ones; None when it holds neither whole."""
    if all(holds(p.name) for p in parts):
        return parts
    legacy = tuple(old for p in parts for old in p.legacy)
    if parts and all(p.legacy for p in parts) and all(holds(p.name) for p in legacy):
        return legacy
    return None


def sliced(parts: tuple[ExportPart, ...], start: int, stop: int) -> tuple[tuple[ExportPart, ...], bool]:
    """What the experts ``start:stop`` (first dimension) of a parameter need of its ``parts``:
    per-expert parts, those experts' (indexed from 0), read whole (False); else the parts
    themselves, each tensor read as its slice ``start:stop`` of the first dimension (True)."""
    if any(p.index is not None for p in parts):
        kept = [(p, p.index) for p in parts if p.index is not None and start <= p.index < stop]
        return tuple(replace(p, index=i - start) for p, i in kept), False
    return parts, True


def assemble(parts: Sequence[ExportPart], values: Sequence[Tensor]) -> Tensor:
    """The trained parameter's full value from its parts' exported tensors ``values``
    (`ExportPart.piece` of each): one part without an index is the whole parameter; parts with
    indices 0..n-1 are its slices, or, ``joined``, its pieces along its first dimension."""
    if len(parts) == 1 and parts[0].index is None:
        return parts[0].piece(values[0])
    index = [-1 if p.index is None else p.index for p in parts]
    order = sorted(range(len(parts)), key=index.__getitem__)
    if [index[i] for i in order] != list(range(len(parts))):
        raise ValueError(f"export parts {[p.name for p in parts]} are not the slices 0..{len(parts) - 1}")
    pieces = [parts[i].piece(values[i]) for i in order]
    return torch.cat(pieces) if all(p.joined for p in parts) else torch.stack(pieces)
