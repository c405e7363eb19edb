"""How a trained parameter appears in an export under the model's own names.

``boost()`` may train a parameter under a name and shape of its own: a user's mixture of
experts converted to ``tessera.moe.MoE`` trains each bank of experts as one stacked tensor
(``experts.w1 [E, d, h]``) where the user's model holds one ``nn.Linear`` per expert
(``experts.<e>.gate_proj.weight [h, d]``). An `ExportPart` names one tensor of the export
and how it is taken from the trained parameter's full value: the slice ``index`` along the
first dimension (None: the whole tensor), transposed or not. ``export`` and
``consolidate`` write the parts in place of the parameter, one at a time as it streams;
`assemble` is the way back (a deferred model's parameters are made under the user's names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ExportPart", "ExportView", "assemble", "export_names", "parts_of"]


@dataclass(frozen=True, slots=True)
class ExportPart:
    """One exported tensor: ``name``, taken as ``full[index]`` (or ``full``), its last two
    dimensions swapped when ``transpose``."""

    name: str
    index: int | None = None
    transpose: bool = False

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        """The exported tensor's shape from the trained parameter's full shape."""
        shape = tuple(full[1:]) if self.index is not None else tuple(full)
        return (*shape[:-2], shape[-1], shape[-2]) if self.transpose else shape

    def take(self, full: Tensor) -> Tensor:
        """The exported tensor from the trained parameter's full value."""
        out = full[self.index] if self.index is not None else full
        return out.transpose(-2, -1).contiguous() if self.transpose else out


@dataclass(frozen=True, slots=True)
class ExportView:
    """An export of other names than the trained ones: ``exported`` maps a parameter to the
    tensors it exports as (over ``Placement.exported``; the empty tuple leaves it out), and
    ``added`` a parameter to what is added to its full value first (an adapter merged into its
    base layer's weight: ``tessera.launcher.checkpoint.adapter_files``)."""

    exported: Mapping[str, tuple[ExportPart, ...]]
    added: Mapping[str, Tensor]


def parts_of(name: str, exported: Mapping[str, tuple[ExportPart, ...]]) -> tuple[ExportPart, ...]:
    """The parts parameter ``name`` exports as (itself, whole, when ``exported`` lacks it; none
    when ``exported`` maps it to the empty tuple: not exported)."""
    return exported[name] if name in exported else (ExportPart(name),)


def export_names(names: Sequence[str], exported: Mapping[str, tuple[ExportPart, ...]]) -> list[str]:
    """Every exported name of the parameters ``names``, in order."""
    return [part.name for name in names for part in parts_of(name, exported)]


def assemble(parts: Sequence[ExportPart], values: Sequence[Tensor]) -> Tensor:
    """The trained parameter's full value from its parts' ``values`` (`ExportPart.take` undone):
    one part without an index is the whole tensor; parts with indices 0..n-1 are its slices."""
    if len(parts) == 1 and parts[0].index is None:
        return values[0].transpose(-2, -1) if parts[0].transpose else values[0]
    index = [-1 if p.index is None else p.index for p in parts]
    order = sorted(range(len(parts)), key=index.__getitem__)
    if [index[i] for i in order] != list(range(len(parts))):
        raise ValueError(f"export parts {[p.name for p in parts]} are not the slices 0..{len(parts) - 1}")
    return torch.stack([values[i].transpose(-2, -1) if parts[i].transpose else values[i] for i in order])
