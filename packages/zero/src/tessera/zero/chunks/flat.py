"""``ChunkedFlatParam``: a FlatParam whose master, gradient shard and optimizer state live in
a ``ChunkStore`` instead of tensors of its own.

Reductions hand their result to the store as they finish (during backward, so at most one
reduced shard exists at a time beyond the chunks). At stage 3 where the master is the
parameter shard (in fp32, and for a frozen FlatParam in any precision), the shard's memory
is released too: each gather refills it from the
chunks before the all-gather and releases it once the gather is done, so the existing
stage-3 hooks (``ParamGatherer``) drive the reads: a prefetch starts the read of the next
unit on the store's background reader, and the all-gather follows when the unit is needed.
Elsewhere the compute shard stays (a view of the full parameters at stages 0-2, a
compute-dtype copy at stage 3 in mixed precision) and the step writes the updated masters
into it; a frozen one at stages 0-2 is not chunked at all (``ChunkStore.holds``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tessera.zero.flat_param import FlatParam, Residency

if TYPE_CHECKING:
    from tessera.zero.chunks.store import ChunkStore

__all__ = ["ChunkedFlatParam"]


class ChunkedFlatParam(FlatParam):
    """A FlatParam backed by a ChunkStore once ``attach`` is called (a plain one before)."""

    store: ChunkStore | None = None
    index = 0
    owns_shard = False
    _read: Future[None] | None = None  # a refill of the shard in flight

    def attach(self, store: ChunkStore, index: int) -> None:
        """Hand this FlatParam's master (already copied into ``store``'s chunks) to the store:
        release the separate master, or at stage 3 the shard that is the master (in fp32, or
        frozen); a frozen one the store does not hold keeps its shard."""
        self.store, self.index = store, index
        self.owns_shard = store.owns(index)
        if self.owns_shard:
            self._release_shard()
        elif self.master is not self.shard:
            self.master = nn.Parameter(torch.empty(0, device=self.master.device), requires_grad=False)

    def _release_shard(self) -> None:
        # the data is swapped rather than its storage resized: the disk tier reads into it
        # through NumPy, which makes a storage non-resizable
        if self.shard.numel():
            self.shard.data = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)

    # ------------------------------------------------------------------ parameters
    def gather_async(self) -> None:
        """Stage 3, the store owning the shard: start refilling it from the chunks (on the store's background
        reader when some are on disk; the all-gather then starts in ``wait_gathered``), else
        start the all-gather as a FlatParam does."""
        if self.residency is Residency.FREE and self.owns_shard and self.store is not None:
            self.shard.data = torch.empty(self.layout.shard_numel, dtype=self.shard.dtype, device=self.device)
            self._read = self.store.read_master_async(self.index, self.shard)
            if self._read is not None:
                self.residency = Residency.GATHERING  # reading; the all-gather is not started yet
                return
        super().gather_async()

    def _finish_read(self) -> bool:
        read, self._read = self._read, None
        if read is None:
            return False
        read.result()
        return True

    def wait_gathered(self) -> None:
        """Wait for the refill and the gather, then release the shard refilled for it."""
        if self.owns_shard and self.store is not None:
            self.store.touch_flat(self.index)  # the use, not the (maybe mispredicted) prefetch
        self.gather_async()  # (a no-op when a prefetch started it)
        if self._finish_read():
            self.residency = Residency.FREE
            FlatParam.gather_async(self)  # the shard is filled: all-gather it now
        super().wait_gathered()
        if self.owns_shard:
            self._release_shard()

    def free(self) -> None:
        """Release the full buffer (and the shard refilled for a gather still in flight)."""
        if self._finish_read():  # read but never gathered: nothing of the full buffer exists
            self.residency = Residency.FREE
        super().free()
        if self.owns_shard and self.store is not None:
            self._release_shard()

    def push_master(self) -> None:
        """A no-op: the chunked step writes the masters into the shard itself."""

    # ------------------------------------------------------------------ gradients
    def finish_reduce(self) -> None:
        """Wait for the reduction and hand the reduced shard to the store's gradient chunks."""
        if self.store is None:
            super().finish_reduce()
            return
        if self._reduce is None:
            return
        handle, _ = self._reduce
        reduced: Tensor = handle.wait()
        self._reduce = None
        self.store.add_grad(self.index, reduced, accumulate=self.has_grad)
        self.has_grad = True

    def master_grad(self) -> Tensor:
        """Not available: the gradient lives in the store's chunks."""
        raise RuntimeError("a chunked FlatParam's gradient lives in its ChunkStore's chunks")

    def release_grads(self) -> None:
        """Drop the gradients, the chunks' included."""
        super().release_grads()
        if self.store is not None:
            self.store.drop_grads(self.index)
