"""Disk chunks stepped as their gradient arrives, during backward (``ChunkConfig.step_in_backward``).

Where the factor a step multiplies the gradients by is known before backward (no clipping,
no fp16 loss scaling: the mean over ranks, ``1 / average_over``), a disk chunk need not write
its gradient to disk and read it back at ``step()``: as the reduced gradient shard arrives,
the chunk's master and optimizer state are read, the optimizer steps it (the same
elementwise arithmetic as at ``step()``, so the same values bit for bit) and the new
streams are written as *pending* files. Per element and step that writes 12 bytes instead of
16 (fp32 AdamW: master and two moments; no gradient) and reads 12 instead of 16 at the step.

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

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from tessera.zero.chunks.chunk import Chunk, Tier
from tessera.zero.chunks.step_one import emptied_groups, step_chunk
from tessera.zero.chunks.tiers import DiskTier
from tessera.zero.flat_param import FlatParam

__all__ = ["EarlySteps"]


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


class EarlySteps:
    """The disk chunks of one ``ChunkStore`` stepped during this backward, not yet committed."""

    def __init__(self, store: Store, factor: float) -> None:
        self.store = store
        self.factor = factor
        self.pending: dict[int, tuple[list[str], dict[str, object]]] = {}

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
        """Step ``chunk`` with its reduced gradient ``grad`` (a host tensor it may change) and
        write its new streams as pending files."""
        store, disk = self.store, self.store.disk
        assert disk is not None
        self.refuse_second(chunk)
        names = ["master", *(n for n in store.state_names if n in chunk.on_disk)]
        streams = store.load(chunk, names)
        streams["grad"] = grad
        scalars = {k: v.clone() if isinstance(v, Tensor) else v for k, v in chunk.scalars.items()}
        with torch.no_grad(), emptied_groups(store.optimizer):
            scalars = step_chunk(store.optimizer, store.state_names, chunk, streams, self.factor, scalars)
        del streams["grad"]
        for name, tensor in streams.items():
            disk.write(chunk.index, name, tensor, pending=True)
        self.pending[chunk.index] = (list(streams), scalars)

    def commit(self) -> set[int]:
        """Make every pending step the chunks' streams (a master is also written into its
        FlatParam's compute shard where the store does not own it); returns their indices."""
        store, disk = self.store, self.store.disk
        done = set(self.pending)
        for index, (names, scalars) in self.pending.items():
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
        return done

    def discard(self, chunk: Chunk) -> None:
        """Forget ``chunk``'s pending step (its gradient is dropped: the step is skipped)."""
        entry = self.pending.pop(chunk.index, None)
        if entry is not None and self.store.disk is not None:
            for name in entry[0]:
                self.store.disk.drop_pending(chunk.index, name)
