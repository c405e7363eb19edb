"""``ZeroState``: what a ``ZeroOptimizer`` shows of its state and how it saves and restores it,
outside the training step.

Inspection: every parameter in full inside ``gathered()``, the full fp32 masters and
gradients by name (a frozen parameter's master is its compute-dtype value, given in fp32),
the bytes held (``memory()``). State: this rank's checkpoint
(``tessera.zero.checkpoint``, or the chunk manager's files), and the portable full state
keyed by parameter name that any stage and world size can load (``tessera.zero.portable``).
``ZeroOptimizer`` inherits these methods; the attributes they read are set by its constructor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from tessera.comm import Group, MemoryReport, measure_memory
from tessera.zero.checkpoint import ShardSave, begin_save, snapshot_writer
from tessera.zero.checkpoint import load as load_checkpoint
from tessera.zero.checkpoint import save as save_checkpoint
from tessera.zero.chunks import ChunkStore
from tessera.zero.chunks.checkpoint import rank_opener, rank_snapshot, rank_writer
from tessera.zero.flat_param import FlatParam
from tessera.zero.grads import GradReducer
from tessera.zero.pool import BufferPool
from tessera.zero.portable import full_state_layout, iter_full_state, load_full_state
from tessera.zero.precision import DynamicLossScaler
from tessera.zero.stage3 import ParamGatherer
from tessera.zero.validate import ZeroOptions

__all__ = ["ZeroState"]


class ZeroState:
    """The inspection and state methods of ``ZeroOptimizer`` (its base class)."""

    # set by ZeroOptimizer.__init__; declared here for the methods below
    model: nn.Module
    optimizer: torch.optim.Optimizer
    group: Group
    device: torch.device
    world_size: int
    config: ZeroOptions
    scaler: DynamicLossScaler | None
    steps: int
    flats: list[FlatParam]
    _trained: list[FlatParam]
    _chunks: ChunkStore | None
    _gatherer: ParamGatherer | None
    _reducer: GradReducer
    _pool: BufferPool | None
    _holder: nn.ParameterList

    if TYPE_CHECKING:  # defined by ZeroOptimizer

        @property
        def stage(self) -> int: ...
        def zero_grad(self) -> None: ...
        def _refresh_params(self, flats: Sequence[FlatParam] | None = None) -> None: ...

    # ------------------------------------------------------------------ inspection
    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Inside the block every parameter of the model holds its full value (stage 3 gathers
        them, collectively; stages 0-2 always do, so it is a no-op there)."""
        if self._gatherer is None:
            yield
            return
        for flat in self.flats:
            flat.wait_gathered()
        try:
            yield
        finally:
            self._gatherer.free_all()

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter's fp32 master value in full, by name, on the host (collective in
        stages 1-3: all-gathers; a ``sharding`` parameter's over its own group). A frozen
        parameter keeps no fp32 master: its value is the compute-dtype one, in fp32 (exact)."""
        if self._chunks is not None:
            return self._by_name([self._chunks.master(i) for i in range(len(self.flats))])
        return self._by_name([f.master for f in self.flats])

    def full_gradients(self) -> dict[str, Tensor]:
        """The fp32 gradients the optimizer is about to step on (averaged, unscaled, clipped),
        in full, by name: call it from an optimizer step pre-hook, on every rank (collective in
        stages 1-3: all-gathers)."""
        if self._chunks is not None:
            raise RuntimeError("full_gradients() is not available with the chunk memory manager (memory=...)")
        grads = [f.master.grad for f in self._trained]
        if any(g is None for g in grads):
            raise RuntimeError("full_gradients() is only valid inside step(), before the optimizer steps")
        return self._by_name([g for g in grads if g is not None], self._trained)

    def _by_name(
        self, shards: Sequence[Tensor], flats: Sequence[FlatParam] | None = None
    ) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for flat, shard in zip(self.flats if flats is None else flats, shards, strict=True):
            full = flat.gather_full(shard)
            for i, name in enumerate(flat.names):
                start, stop = flat.layout.span(i)
                out[name] = full[start:stop].view(flat.params[i].shape).to("cpu", torch.float32, copy=True)
        return out

    def declared_buffers(self) -> list[Tensor]:
        """Transient buffers held right now beyond model state: the output shards of reductions
        in flight (none between steps; their flat inputs are held by the backend) and, in stage
        3, the spare memory waiting for reuse (none outside a forward or backward)."""
        spares = [] if self._pool is None else self._pool.held()
        return self._reducer.in_flight() + spares

    def memory(self) -> MemoryReport:
        """Bytes held by this rank, by storage: parameters (full or gathered compute copies,
        shards, masters), gradients (parameter and shard), optimizer state, declared buffers;
        with the chunk memory manager, what its chunks hold is in ``chunk_report()``."""
        return measure_memory(
            modules=[self.model, self._holder], optimizers=[self.optimizer], tensors=self.declared_buffers()
        )

    # ------------------------------------------------------------------ state
    def save(self, path: str | Path) -> None:
        """Write this rank's shards and optimizer state under directory ``path`` (collective;
        stage 0 writes its replicated state once, from rank 0): fp32 masters, and a frozen
        parameter's compute-dtype value (``tessera.zero.checkpoint``)."""
        save_checkpoint(self, Path(path), None if self._chunks is None else rank_writer(self, self._chunks))

    def begin_save(self, path: str | Path) -> tuple[ShardSave, int]:
        """``save`` in halves, from a host copy of this rank's state taken now (no collective;
        ``ShardSave``), and the bytes copied: training may go on before ``write``."""
        copy = snapshot_writer(self) if self._chunks is None else rank_snapshot(self, self._chunks)
        return begin_save(self, Path(path), copy[0]), copy[1]

    def load(self, path: str | Path) -> None:
        """Load what ``save`` wrote, at the same world size and layout (collective); every rank
        raises if any rank finds the checkpoint invalid."""
        opener = None if self._chunks is None else rank_opener(self, self._chunks)
        self._restored(load_checkpoint(self, Path(path), opener))

    def full_state(self) -> dict[str, Tensor]:
        """Masters and optimizer state in full by parameter name, independent of the stage and
        world size: ``dict(iter_full_state())`` (the whole model at once; collective)."""
        return dict(self.iter_full_state())

    def iter_full_state(
        self, *, params_only: bool = False, trained_only: bool = False
    ) -> Iterator[tuple[str, Tensor]]:
        """``(key, tensor)`` for every parameter's master and optimizer state in full (fp32, on
        the host) and each group's scalar state, one at a time, in ``full_state_layout()``'s
        order (``tessera.zero.portable``). Collective (an all-gather per flat buffer and
        kind, each over the group it is sharded over: a ``sharding`` parameter is whole over
        its own group, as every rank of that group holds it): every rank consumes it to the end.
        ``params_only``: the fp32 masters alone, one flat buffer at a time (an export). A
        frozen parameter's ``param/`` value is its compute-dtype value (in fp32, exactly).
        ``trained_only`` (with ``params_only``): the trained parameters' masters alone."""
        return iter_full_state(self, self._chunks, params_only=params_only, trained_only=trained_only)

    def full_state_layout(
        self, *, params_only: bool = False, trained_only: bool = False
    ) -> list[tuple[str, tuple[int, ...]]]:
        """``(key, shape)`` of what ``iter_full_state()`` yields now, in order; no communication.
        Optimizer state exists once the optimizer has stepped: before the first step only the
        ``param/`` keys."""
        return full_state_layout(self, self._chunks, params_only=params_only, trained_only=trained_only)

    def load_full_state(self, state: Mapping[str, Tensor], steps: int) -> None:
        """Restore what ``iter_full_state`` yielded, saved under any stage and world size, reading
        ``state`` one parameter at a time (a lazy mapping is never loaded whole); local."""
        load_full_state(self, state, self._chunks)
        self._restored(steps)

    def _restored(self, steps: int) -> None:  # after loading: no gradients, params from masters
        self.steps = steps
        self.zero_grad()
        for flat in self.flats:
            flat.push_master()
        self._refresh_params(self.flats)

    def chunk_report(self) -> dict[str, Any] | None:
        """``ChunkStore.report`` (bytes and chunks per tier, disk traffic); None without ``memory``."""
        return None if self._chunks is None else self._chunks.report()
