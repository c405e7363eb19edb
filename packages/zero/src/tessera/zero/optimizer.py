"""``ZeroOptimizer``: plain data parallelism (stage 0) and ZeRO stages 1-3 around any
elementwise torch.optim optimizer.

The user builds the model and a torch optimizer over its parameters, then hands both over::

    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2,
                         group=dp_group, precision="bf16", clip_grad_norm=1.0)
    loss = model.loss(idx, targets)      # this rank's microbatch, mean loss
    zero.backward(loss)
    zero.step()                          # False when an fp16 overflow skipped the step

Each optimizer group's parameters are flattened into FlatParams (stage 0-2: buckets of
``bucket_bytes``; stage 3: one per unit module), and the optimizer is rewired to step this
rank's fp32 master shards, one optimizer parameter per FlatParam, with its group's
hyperparameters. Stage 0 does not shard: each rank's "shard" is the whole buffer, the
gradients are all-reduced bucket by bucket at ``step()`` and every rank steps everything,
as DDP does. Per step each stage moves, by the paper accounting, the padded parameter bytes
(in the compute dtype) twice: an all-reduce in stage 0, a reduce-scatter of gradients and an
all-gather of updated parameters in stages 1-2; three times in stage 3 (all-gathers in
forward and backward, reduce-scatter), less the backward all-gather of the units kept
gathered from forward into backward (``keep_for_backward``); plus 32 bytes for the
gradient norm / non-finite check, every step (stage 0: only over ``norm_groups``, as its
gradients are already the same on every data-parallel rank). A step whose gradient norm is
not finite is skipped in every precision (fp16: the loss scale also halves), so a
divergence never writes NaN weights.

Stages 0 and 1 reduce at ``step()``, so a caller that runs backward itself (a pipeline
runtime calling ``loss.backward()`` per microbatch) simply lets the gradients accumulate in
``param.grad`` and calls ``step()``; stages 2-3 reduce from hooks during each backward.

Averaging: the gradient stepped is the mean over ranks of each rank's gradient (summed over
its microbatches): with per-rank mean losses over equal microbatches, the serial gradient of
the mean loss over every rank's batch (divide each microbatch loss by their count).

Its inspection, checkpoint and full-state methods come from ``tessera.zero.state.ZeroState``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from tessera.comm import Group, group_size
from tessera.zero.chunks import ChunkConfig, ChunkedFlatParam, ChunkStore
from tessera.zero.chunks.build import build_store
from tessera.zero.chunks.step import chunk_grad_stats, step_chunks
from tessera.zero.clip import clip_coefficient, global_grad_stats
from tessera.zero.flat import BUCKET_BYTES
from tessera.zero.flat_param import FlatParam
from tessera.zero.grads import GradReducer, HookRunner
from tessera.zero.groups import build_flats, mixed_groups, norm_weights
from tessera.zero.offload import sync_device
from tessera.zero.pool import BufferPool
from tessera.zero.precision import DynamicLossScaler, Precision, cast_buffers_, compute_dtype
from tessera.zero.stage3 import ParamGatherer
from tessera.zero.state import ZeroState
from tessera.zero.units import default_units
from tessera.zero.validate import ZeroOptions, collect_params, resolve_device

__all__ = ["ZeroOptimizer"]

log = logging.getLogger(__name__)


class ZeroOptimizer(ZeroState):
    """Averages gradients over ``group`` (stage 0, plain data parallelism), or also shards
    optimizer state (stage 1), gradients (2) and parameters (3) over it.

    ``optimizer`` must be a fresh torch optimizer over every trainable parameter of ``model``
    (all on one device); it is rewired in place to step this rank's shards, so an LR scheduler
    built on it keeps working. Frozen parameters (``requires_grad=False``, in the optimizer
    or not) are sharded and gathered like the others but never reduced nor stepped, as a
    torch optimizer leaves a parameter without a gradient; which are frozen is read here.
    They keep their compute-dtype values only: no fp32 master (under bf16/fp16), nothing on
    the host (with offload), no gradient buffer, no optimizer state; what is saved, exported
    and returned by ``full_parameters`` for them is that compute-dtype value.
    ``precision``: compute dtype (the model's parameters and floating buffers are cast to it;
    fp32 masters are kept). ``offload``: master shards, their gradients, the optimizer state
    and the step live on the host.
    ``clip_grad_norm``: clip the global gradient norm like ``clip_grad_norm_``.
    ``bucket_bytes``: stage 1-2 bucket size. ``units``: stage-3 modules to gather together
    (default: ``default_units(model)``). ``loss_scaler``: fp16's (a default one if None).
    Stage 3 only: ``prefetch`` starts the next unit's all-gather while the current one
    computes (``prefetch_depth`` units ahead, each holding one more unit gathered);
    ``keep_for_backward`` keeps the model's own parameters and the last unit's gathered from
    the end of forward into backward, which needs them first (no extra peak;
    ``tessera.zero.stage3``); ``reuse_buffers`` hands freed gathered and gradient memory to
    the next unit of the same size instead of allocating anew (``tessera.zero.pool``: at
    most one unit's parameters and one gradient buffer wait for reuse, none after backward;
    not with ``memory``).

    Under tensor or pipeline parallelism the model here is this rank's part: pass the
    model-parallel groups as ``norm_groups`` (the squared gradient norm and the overflow flag
    are summed over them too, so clipping and loss scaling agree on every rank) and, in
    ``replication``, how many model-parallel ranks hold an identical copy of each replicated
    parameter (e.g. tp for a LayerNorm not split by tensor parallelism), so it counts once.

    ``average_over``: the gradient stepped is the sum over ``group`` divided by this (default:
    the group size, i.e. the mean). Pass the data-parallel degree when ``group`` also spans
    context-parallel ranks, whose gradients are partial sums of one replica's gradient.

    ``memory``: the chunk memory manager (``tessera.zero.chunks``): masters, gradient shards
    and optimizer state (and at stage 3 in fp32 the parameter shards) in chunks on the
    device, host and disk under the budgets of a ``ChunkConfig``, stepped chunk by chunk;
    at stage 3 frozen parameter shards too, in the compute dtype, placed but never stepped.
    Without clipping and fp16 loss scaling, disk chunks step during backward as their
    gradient arrives and commit at ``step()`` (``ChunkConfig.step_in_backward``,
    ``tessera.zero.chunks.early``): the same values, 12 bytes written per element instead of 16.

    ``sharding``: parameters sharded and reduced over another group than ``group`` (expert
    parameters over their expert-data-parallel group, ``tessera.zero.groups``), still divided
    by ``average_over``; their full state is per group, so ``full_state`` and its kin refuse.

    ``init``: the value of a parameter left on the meta device (deferred initialization), in
    the shape the model holds it, any dtype; called while the FlatParams are filled, one at
    a time, so no more than one FlatParam's values exist at once on any rank (with ``memory``,
    each is handed to the chunks, on disk if so placed, before the next is made). ``device``:
    where the parameters live (default: where the real ones are; needed when all are meta).

    ``keep_fp32``: parameters and buffers of ``model`` computed in fp32 whatever ``precision``
    (a router, a score-correction bias: what a Hugging Face family keeps in fp32 in bf16,
    ``_keep_in_fp32_modules_strict``); such parameters get FlatParams of their own, whose
    gathers, gradients and reductions are fp32 (their masters are fp32 like every other).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        group: Group = None,
        precision: Precision | str = Precision.FP32,
        offload: bool = False,
        clip_grad_norm: float | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        units: Sequence[nn.Module] | None = None,
        prefetch: bool = True,
        prefetch_depth: int = 1,
        keep_for_backward: bool = True,
        reuse_buffers: bool = True,
        loss_scaler: DynamicLossScaler | None = None,
        norm_groups: Sequence[Group] = (),
        replication: Mapping[nn.Parameter, int] | None = None,
        average_over: int | None = None,
        memory: ChunkConfig | None = None,
        sharding: Mapping[nn.Parameter, Group] | None = None,
        init: Callable[[nn.Parameter], Tensor] | None = None,
        device: torch.device | None = None,
        keep_fp32: Collection[Tensor] = (),
    ) -> None:
        if memory is not None and sharding:
            raise ValueError("sharding= (other groups) with memory=ChunkConfig() is not built")
        if memory is not None and offload:
            raise ValueError(
                "offload=True and memory=ChunkConfig(...) exclude each other: "
                "the chunk manager places the host tier itself"
            )
        self.config = ZeroOptions(stage, precision, offload, clip_grad_norm, bucket_bytes)
        self.norm_groups = tuple(norm_groups)
        dtype = compute_dtype(precision)
        named, group_of = collect_params(model, optimizer, deferred=init is not None)
        self.device = resolve_device(named, device)
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.world_size = group_size(group)
        self.average_over = self.world_size if average_over is None else average_over
        if not 1 <= self.average_over <= self.world_size or self.world_size % self.average_over:
            raise ValueError(
                f"average_over={average_over} must divide the group size {self.world_size} (the ranks "
                "whose gradients are averaged; the others contribute partial sums)"
            )
        self.dtype = dtype
        fp32 = {id(t) for t in keep_fp32}
        n_groups = len(optimizer.param_groups)

        def make(pairs: list[tuple[str, nn.Parameter]], gi: int, sharded: bool, over: Group) -> FlatParam:
            held = torch.float32 if id(pairs[0][1]) in fp32 else dtype  # `build_flats` keeps them apart
            return (ChunkedFlatParam if memory is not None else FlatParam)(
                [p for _, p in pairs],
                [n for n, _ in pairs],
                group_index=gi,
                group=over,
                compute_dtype=held,
                offload=offload,
                sharded=sharded,
                replicated=stage == 0,
                frozen=gi == n_groups,
                align=max(1, 16 // held.itemsize),
                device=self.device,
            )

        self.flats, self.units = build_flats(
            model, named, group_of, stage=stage, n_groups=n_groups, bucket_bytes=bucket_bytes,
            itemsize=dtype.itemsize, units=default_units(model) if units is None else list(units),
            group=group, sharding=sharding or {}, make=make, apart=fp32,
        )  # fmt: skip
        cast_buffers_(model, dtype, keep=fp32)
        self._trained = [f for f in self.flats if not f.frozen]  # the ones reduced and stepped
        # some stepped parameters sharded over ``sharding``'s groups (frozen ones count in no norm)
        self._mixed = mixed_groups(self._trained, group)
        self._norm_weights = norm_weights(self._trained, group, stage=stage, replication=replication)
        self._chunks: ChunkStore | None = None
        if memory is not None:
            weights = self._norm_weights if replication else None  # (no ``sharding`` with memory)
            self._chunks = build_store(
                model, self.flats, optimizer, memory, stage=stage, group=group, weights=weights
            )
        for i, flat in enumerate(self.flats):  # one at a time: a deferred model is made here, by flat
            flat.fill(None if init is None else _values_of(flat, init))
            if self._chunks is not None:
                assert isinstance(flat, ChunkedFlatParam)  # ``make`` builds them with ``memory``
                self._chunks.take(i)
                flat.attach(self._chunks, i)  # releases its own copy
        if self._chunks is not None:
            self._chunks.log_report("placed")
        else:
            for gi, param_group in enumerate(optimizer.param_groups):
                param_group["params"] = [f.master for f in self.flats if f.group_index == gi]
            optimizer.state.clear()
        self._pool = BufferPool() if stage == 3 and reuse_buffers and memory is None else None
        for flat in self.flats if self._pool is not None else []:
            flat.pool = self._pool

        self._runner = HookRunner()
        self._gatherer = (
            ParamGatherer(
                model,
                self.units,
                self._runner,
                prefetch=prefetch,
                prefetch_depth=prefetch_depth,
                keep_for_backward=keep_for_backward,
                pool=self._pool,
            )
            if stage == 3
            else None
        )
        self._reducer = GradReducer(
            self._trained,
            self._runner,
            overlap=stage >= 2,
            on_final=(lambda f: f.free()) if stage == 3 else None,
        )
        self.scaler = (
            loss_scaler if loss_scaler is not None else (DynamicLossScaler() if precision == "fp16" else None)
        )
        self._holder = nn.ParameterList(_unique([t for f in self.flats for t in (f.shard, f.master)]))
        self.last_grad_norm: float | None = None
        self._accumulated = False  # gradients of an ``accumulating`` block wait for step()
        self.steps = 0
        if self._chunks is not None and memory is not None and memory.step_in_backward:
            # the step's factor is known before backward only without clipping and loss scaling
            known = clip_grad_norm is None and self.scaler is None
            self._chunks.step_in_backward(1.0 / self.average_over if known else None)

    # ------------------------------------------------------------------ properties
    @property
    def stage(self) -> int:
        """The ZeRO stage: 0 (plain data parallelism), 1, 2 or 3."""
        return self.config.stage

    @property
    def loss_scale(self) -> float:
        """The factor ``backward`` multiplies the loss by (1 without fp16 loss scaling)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    # ------------------------------------------------------------------ training
    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` (scaled for fp16); outside ``no_sync``, stages 2-3 reduce-scatter
        the gradients during backward so each rank ends with its shard (stages 0-1 reduce at
        ``step``; plain ``loss.backward()`` works for them too)."""
        self._runner.begin()
        scaled = loss if self.scaler is None else self.scaler.scale_loss(loss)
        torch.autograd.backward(scaled)
        self._finish_backward()

    def _finish_backward(self) -> None:
        self._reducer.finish_backward()
        if self._gatherer is not None:
            self._gatherer.free_all()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients in ``param.grad`` over microbatches without communicating
        them (stage 3 still gathers parameters); the backward after the block reduces."""
        previous = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = previous

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Run any number of backwards, in any order, as one step's: a pipeline's microbatches
        (whose split backwards a zero-bubble schedule interleaves across stages), or a caller
        that must adjust the gradients before they are reduced (sequence-parallel norms summed
        over tp). Stage 3 gathers every parameter once on entry and keeps it until ``step()``;
        every stage lets the gradients accumulate in ``param.grad``, and ``step()`` then
        reduces them once, as stage 1 does (stages 2-3 hold full gradients during the block).
        """
        self._runner.begin()
        if self._gatherer is not None:
            for flat in self.flats:
                flat.wait_gathered()
                flat.prepare_grads()
            self._gatherer.held = True
        self._reducer.held = True
        self._accumulated = True
        try:
            yield
        finally:
            self._reducer.held = False
            if self._gatherer is not None:
                self._gatherer.held = False

    def step(self) -> bool:
        """Average the gradient shards over ranks, unscale, clip, step the optimizer on the
        masters and update the parameters; returns False when an overflow skipped the step.

        The gradients are consumed either way (no ``zero_grad`` is needed before the next
        backward). Stages 0-2 end with every rank's parameters updated in full.
        """
        if any(f.ready_params or f.launched for f in self.flats):
            self._finish_backward()  # backward ran without ZeroOptimizer.backward
        if self.stage <= 1 or self._accumulated:
            self._reducer.reduce_all()
            if self._gatherer is not None:
                self._gatherer.free_all()
        else:
            self._reducer.wait_all()
        if self._pool is not None:  # (already released at the end of backward)
            self._pool.close()
        self._accumulated = False
        if self.config.offload:
            sync_device(self.device)
        factor = 1.0 / (self.average_over * self.loss_scale)
        if self._chunks is not None:
            grads: list[Tensor] = []
            stats = chunk_grad_stats(
                self._chunks,
                self.group,
                self.device,
                extra_groups=self.norm_groups,
                replicated=self.stage == 0,
            )
        else:
            grads = [f.master_grad() for f in self._trained]
            stats = global_grad_stats(  # every step: a non-finite norm skips it in every precision
                grads,
                self.group,
                self.device,
                extra_groups=self.norm_groups,
                weights=self._norm_weights,
                replicated=self.stage == 0 and not self._mixed,
            )
        if stats.overflow:
            return self._skip()
        self.last_grad_norm = stats.norm * factor
        if self.config.clip_grad_norm is not None:
            factor *= clip_coefficient(self.last_grad_norm, self.config.clip_grad_norm)
        if self._chunks is not None:
            step_chunks(self._chunks, self.flats, factor)
        else:
            if factor != 1.0 and grads:  # (none: every parameter of this rank is frozen)
                torch._foreach_mul_(grads, factor)
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(False)
        for flat in self._trained:
            flat.release_grads()
            flat.push_master()
        self._refresh_params()
        self.steps += 1
        return True

    def _skip(self) -> bool:
        if self.scaler is not None:
            self.scaler.update(True)
            log.info("gradient overflow: step skipped, loss scale now %s", self.scaler.scale)
        else:
            log.warning("non-finite gradient norm: step skipped, the weights are unchanged")
        self.last_grad_norm = float("inf")
        self.zero_grad()
        return False

    def _refresh_params(self, flats: Sequence[FlatParam] | None = None) -> None:
        """All-gather the updated shards of ``flats`` (default: the stepped ones) into the
        parameters (stages 1-2; stage 3 gathers on use, stage 0 holds them whole)."""
        if self.stage in (1, 2):
            for handle in [f.gather_params_async() for f in (self._trained if flats is None else flats)]:
                handle.wait()

    def zero_grad(self) -> None:
        """Drop every gradient: the parameters' and this rank's shards."""
        self._reducer.wait_all()
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
            flat.release_grads()
        if self._pool is not None:
            self._pool.close()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the chunk manager's thread, hooks and disk directory and the spare buffers."""
        if self._chunks is not None:
            self._chunks.close()
            self._chunks = None
        if self._pool is not None:
            self._pool.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"ZeroOptimizer(stage={c.stage}, world={self.world_size}, precision={c.precision}, "
            f"offload={c.offload}, flats={len(self.flats)}, optimizer={type(self.optimizer).__name__})"
        )


def _values_of(flat: FlatParam, init: Callable[[nn.Parameter], Tensor]) -> Callable[[int], Tensor]:
    return lambda i: init(flat.params[i])


def _unique(tensors: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(t): t for t in tensors}.values())  # each once, in order of first occurrence
