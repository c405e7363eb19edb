"""Stage 3's spare memory: freed buffers handed to the next buffer of the same size.

Stage 3 frees each unit's gathered parameters after use and gathers the next unit's, and
allocates a flat gradient buffer per unit per backward. On the CPU each such allocation is
fresh memory from the system (glibc maps large blocks and unmaps them when freed), so every
gather and every gradient buffer first pays its page faults, on the two cores that also run
the forward and backward; a GPU's caching allocator reuses memory instead. ``BufferPool``
does that reuse here, for one ``ZeroOptimizer``:

- a freed FlatParam's full buffer keeps its storage (the parameters and every view autograd
  saved of them stay attached to it); only the memory behind it moves into the pool, and
  the next gather of a buffer of the same byte size takes it back, by swapping the two
  storages' data pointers (``_swap_data_ptr_``, a private torch storage method; without it
  the pool keeps nothing and storages are resized as before);
- a reduced flat gradient buffer goes back to the pool once its reduce-scatter is done, and
  the next unit's backward takes it (zeroed) instead of a new ``torch.zeros``.

At most ``max_per_size`` spares of each size are kept (one by default: a freed unit's
memory goes to the unit gathered after it), and a spare waits only for the next request of
its kind (parameters, gradients): a request of another size releases it, as a unit of
another size (an embedding, a head) would otherwise keep its spare until the same-sized
unit comes round again, holding its memory through the whole forward or backward. So
beyond what the schedule had live anyway the pool holds at most one unit's parameters
and one unit's gradient buffer, each from a free to the next gather. ``close`` releases them all and lets what
is freed afterwards go straight back to the system, until ``open``: the stage-3 hooks open
the pool at the start of a forward and close it once backward has taken its last buffers
(and at the end of a forward without gradients), so no spare adds to the high point at the
end of backward and nothing is held between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["BufferPool"]

_SWAP = "_swap_data_ptr_"


class BufferPool:
    """Spare parameter storages and flat gradient buffers, by size, for reuse (see module)."""

    def __init__(self, *, max_per_size: int = 1) -> None:
        if max_per_size < 0:
            raise ValueError(f"max_per_size must be >= 0, got {max_per_size}")
        self.max_per_size = max_per_size
        self._storages: dict[tuple[str, int], list[Tensor]] = {}  # 0-size uint8 tensors owning memory
        self._grads: dict[tuple[str, torch.dtype, int], list[Tensor]] = {}
        self.reused = 0  # allocations served from the pool (parameters and gradients), for tests
        self.accepting = True  # whether freed memory is kept (see ``open`` / ``close``)

    # ------------------------------------------------------------------ parameters
    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` (empty) ``nbytes`` of memory: a spare of that size, else new memory."""
        spares = _only(self._storages, (str(storage.device), nbytes))
        if spares:
            spare = spares.pop()
            getattr(storage, _SWAP)(spare.untyped_storage())
            self.reused += 1
            return
        storage.resize_(nbytes)

    def release(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory away (it is left empty): into the pool, or back to the system."""
        nbytes = storage.nbytes()
        spares = self._storages.setdefault((str(storage.device), nbytes), [])
        if self.accepting and nbytes and len(spares) < self.max_per_size and hasattr(storage, _SWAP):
            holder = torch.empty(0, dtype=torch.uint8, device=storage.device)
            getattr(storage, _SWAP)(holder.untyped_storage())
            spares.append(holder)
            return
        storage.resize_(0)

    # ------------------------------------------------------------------ gradients
    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A zeroed 1-D buffer: a spare of that size zeroed again, else ``torch.zeros``."""
        spares = _only(self._grads, (str(device), dtype, numel))
        if spares:
            self.reused += 1
            return spares.pop().zero_()
        return torch.zeros(numel, dtype=dtype, device=device)

    def give(self, buffer: Tensor) -> None:
        """Hand back a 1-D buffer that nothing reads any more (kept if there is room)."""
        spares = self._grads.setdefault((str(buffer.device), buffer.dtype, buffer.numel()), [])
        if self.accepting and len(spares) < self.max_per_size:
            spares.append(buffer)

    # ------------------------------------------------------------------ accounting
    def held(self) -> list[Tensor]:
        """Every spare held now (tensors whose storages own the memory)."""
        return [t for group in (*self._storages.values(), *self._grads.values()) for t in group]

    def open(self) -> None:
        """Keep freed memory for reuse from now on."""
        self.accepting = True

    def close(self) -> None:
        """Release every spare; memory freed from now on goes back to the system."""
        self.accepting = False
        self._storages.clear()
        self._grads.clear()


def _only(table: dict[Any, list[Tensor]], key: Any) -> list[Tensor] | None:
    """The spares under ``key``, after releasing every other size's (see the module)."""
    for other in [k for k in table if k != key]:
        del table[other]
    return table.get(key)
