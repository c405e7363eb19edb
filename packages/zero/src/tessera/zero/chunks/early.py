"""Disk chunks stepped as their gradient arrives, during backward (``ChunkConfig.step_in_backward``).

Where the factor a step multiplies the gradients by is known before backward (no clipping,
no fp16 loss scaling: the mean over ranks, ``1 / average_over``), a disk chunk need not write
its gradient to disk and read it back at ``step()``: as the reduced gradient shard arrives,
the chunk's master and optimizer state are read, the optimizer steps it (the same
elementwise arithmetic as at ``step()``, so the same values bit for bit) and the new
streams are written as *pending* files. Per element and step that writes 12 bytes instead of
16 (fp32 AdamW: master and two moments; no gradient) and reads 12 instead of 16 at the step.

The step runs on a background thread (at most two chunks in flight), so the optimizer's
arithmetic and the writes, which the kernel throttles to the disk's pace, go on while
backward computes. The streams it read are dropped from the page cache (their files stay
until the commit), so the old and new streams of every disk chunk do not compete for it:
where the page cache holds the disk chunks, the next step's reads still come from it.

Nothing is visible before ``step()``: reads (the stage-3 gathers still to come in this
backward, checkpoints, the full state) see the committed streams; ``step()`` checks the
global gradient norm as always and then commits the pending files (one rename each), or,
when the norm is not finite, the step is skipped and they are dropped with the gradients,
as ``zero_grad`` drops them. The gradient norm is taken from the gradient before the step,
as at ``step()``.

A step in backward takes one reduced gradient per chunk and step: a second one for a chunk
already stepped (a second backward that reduces before ``step()``, outside ``no_sync`` or
``accumulating``) is refused, since its first gradient was never kept. The warm-up step
(the first) steps at ``step()``, as it places the chunks by what it measures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import Tensor

from tessera.zero.chunks.chunk import Chunk, Tier
from tessera.zero.chunks.step_one import emptied_groups, step_chunk
from tessera.zero.chunks.tiers import DiskTier
from tessera.zero.flat_param import FlatParam

__all__ = ["EarlySteps"]

log = logging.getLogger(__name__)


class Store(Protocol):
    """What of a ``ChunkStore`` the early steps use (the store holds them: no import back)."""

    disk: DiskTier | None
    warm: bool
    optimizer: torch.optim.Optimizer
    state_names: tuple[str, ...]
    chunks: list[Chunk]
    flats: list[FlatParam]

    def load(self, chunk: Chunk, names: Sequence[str]) -> dict[str, Tensor]: ...

    def owns(self, flat_index: int) -> bool: ...


_Done = tuple[list[str], dict[str, object]]  # the streams written as pending, the new scalars


class EarlySteps:
    """The disk chunks of one ``ChunkStore`` stepped during this backward, not yet committed.

    Each step (read, optimizer, pending writes) runs on a background thread while backward
    goes on, at most ``depth`` submitted and unfinished at once (what they hold, a chunk's
    gradient and streams each, stays within the store's staging allowance of two chunks)."""

    def __init__(self, store: Store, factor: float, *, depth: int = 2) -> None:
        self.store = store
        self.factor = factor
        self.depth = depth
        self.pending: dict[int, Future[_Done]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def takes(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` steps when its gradient arrives (a trained disk chunk, after the
        warm-up step)."""
        return chunk.tier is Tier.DISK and not chunk.frozen and self.store.warm

    def refuse_second(self, chunk: Chunk) -> None:
        """A RuntimeError when ``chunk`` already stepped in this backward."""
        if chunk.index in self.pending:
            raise RuntimeError(
                f"chunk {chunk.index} (flat buffer {chunk.flat_index}) already stepped in this backward "
                "(zero.step_in_backward): a second gradient reduced before step() cannot be added to a "
                "first that was never kept; run the earlier backwards under no_sync() or accumulating(), "
                "or set step_in_backward=False"
            )

    def step(self, chunk: Chunk, grad: Tensor) -> None:
        """Start stepping ``chunk`` with its reduced gradient ``grad`` (a host tensor it may
        change) on the background thread; its new streams are written as pending files."""
        self.refuse_second(chunk)
        running = [f for f in self.pending.values() if not f.done()]
        while len(running) >= self.depth:
            running.pop(0).result()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-chunk-early")
        self.pending[chunk.index] = self._pool.submit(self._step, chunk, grad)

    def _step(self, chunk: Chunk, grad: Tensor) -> _Done:
        store, disk = self.store, self.store.disk
        assert disk is not None
        names = ["master", *(n for n in store.state_names if n in chunk.on_disk)]
        streams = store.load(chunk, names)
        for name in names:  # read for the last time unless the step is skipped: out of the page cache
            disk.uncache(chunk.index, name)
        streams["grad"] = grad
        scalars = {k: v.clone() if isinstance(v, Tensor) else v for k, v in chunk.scalars.items()}
        with torch.no_grad(), emptied_groups(store.optimizer):
            scalars = step_chunk(store.optimizer, store.state_names, chunk, streams, self.factor, scalars)
        del streams["grad"]
        for name, tensor in streams.items():
            disk.write(chunk.index, name, tensor, pending=True)
        return list(streams), scalars

    def commit(self) -> set[int]:
        """Wait for every step, then make each the chunk's streams (a master is also written
        into its FlatParam's compute shard where the store does not own it); returns their
        indices. A step that failed raises here, nothing committed."""
        store, disk = self.store, self.store.disk
        done = {index: future.result() for index, future in self.pending.items()}
        for index, (names, scalars) in done.items():
            chunk = store.chunks[index]
            assert disk is not None
            for name in names:
                disk.commit(index, name)
                chunk.on_disk.add(name)
            chunk.scalars = scalars
            if not store.owns(chunk.flat_index):
                with torch.no_grad():
                    master = store.load(chunk, ["master"])["master"]
                    store.flats[chunk.flat_index].shard.detach()[chunk.lo : chunk.hi].copy_(master)
        self.pending.clear()
        return set(done)

    def discard(self, chunk: Chunk) -> None:
        """Forget ``chunk``'s pending step (its gradient is dropped: the step is skipped), once
        it has finished; whatever it wrote is removed, even if it failed."""
        future = self.pending.pop(chunk.index, None)
        if future is None or self.store.disk is None:
            return
        exception = future.exception()
        if exception is not None:
            log.warning(
                "the step of chunk %d taken in backward failed and is dropped: %s", chunk.index, exception
            )
        for name in ("master", *self.store.state_names):
            self.store.disk.drop_pending(chunk.index, name)

    def close(self) -> None:
        """Wait for the background thread and stop it (pending steps stay pending)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
