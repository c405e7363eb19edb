"""A meter of the bytes held by tensors, modules and optimizers, counted by storage.

Two views of one storage count once, and a storage counts in full even when only a slice of
it is referenced (that is what the allocator holds). Each storage is attributed to the first
category that reaches it, in the order parameters, gradients, buffers, optimizer state,
other tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["MemoryReport", "measure_memory", "storage_bytes"]


def _key(t: Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes held per category, each storage counted once."""

    parameters: int = 0
    gradients: int = 0
    buffers: int = 0
    optimizer_state: int = 0
    other: int = 0
    by_device: dict[str, int] = field(default_factory=dict)

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state: the ZeRO papers' model-state bytes."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        """Every category together."""
        return self.parameters + self.gradients + self.buffers + self.optimizer_state + self.other


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    out: list[Tensor] = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                out.append(value)
    return out


def measure_memory(
    *,
    modules: Iterable[nn.Module] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    tensors: Iterable[Tensor] = (),
) -> MemoryReport:
    """Count the bytes held by the parameters, gradients and buffers of ``modules``, the state
    of ``optimizers`` (its parameters are counted only through ``modules``) and ``tensors``.
    """
    mods = list(modules)
    categories: list[tuple[str, list[Tensor]]] = [
        ("parameters", [p for m in mods for p in m.parameters()]),
        ("gradients", [p.grad for m in mods for p in m.parameters() if p.grad is not None]),
        ("buffers", [b for m in mods for b in m.buffers()]),
        ("optimizer_state", [t for o in optimizers for t in _optimizer_tensors(o)]),
        ("other", list(tensors)),
    ]
    seen: set[tuple[str, int]] = set()
    totals = dict.fromkeys((name for name, _ in categories), 0)
    by_device: dict[str, int] = {}
    for name, items in categories:
        for t in items:
            nbytes = t.untyped_storage().nbytes()
            key = _key(t)
            if nbytes == 0 or key in seen:
                continue
            seen.add(key)
            totals[name] += nbytes
            by_device[str(t.device)] = by_device.get(str(t.device), 0) + nbytes
    return MemoryReport(**totals, by_device=by_device)
