"""How a trained parameter appears in an export under the model's own names.

``boost()`` may train a parameter under a name and shape of its own: a user's mixture of
experts converted to ``tessera.moe.MoE`` trains each bank of experts as one stacked tensor
(``experts.w1 [E, d, h]``) where the user's model holds one ``nn.Linear`` per expert
(``experts.<e>.gate_proj.weight [h, d]``). An `ExportPart` names one tensor of the export
and how it is taken from the trained parameter's full value: the slice ``index`` along the
first dimension (None: the whole tensor), transposed or not. ``export`` and
``consolidate`` write the parts in place of the parameter, one at a time as it streams.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["ExportPart", "export_names", "parts_of"]


@dataclass(frozen=True, slots=True)
class ExportPart:
    """One exported tensor: ``name``, taken as ``full[index]`` (or ``full``), transposed when
    ``transpose`` (a 2-D tensor)."""

    name: str
    index: int | None = None
    transpose: bool = False

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        """The exported tensor's shape from the trained parameter's full shape."""
        shape = tuple(full[1:]) if self.index is not None else tuple(full)
        return (shape[1], shape[0]) if self.transpose else shape

    def take(self, full: Tensor) -> Tensor:
        """The exported tensor from the trained parameter's full value."""
        out = full[self.index] if self.index is not None else full
        return out.t().contiguous() if self.transpose else out


def parts_of(name: str, exported: Mapping[str, tuple[ExportPart, ...]]) -> tuple[ExportPart, ...]:
    """The parts parameter ``name`` exports as (itself, whole, when ``exported`` lacks it)."""
    return exported.get(name) or (ExportPart(name),)


def export_names(names: Sequence[str], exported: Mapping[str, tuple[ExportPart, ...]]) -> list[str]:
    """Every exported name of the parameters ``names``, in order."""
    return [part.name for name in names for part in parts_of(name, exported)]
