"""One flat, sharded group of parameters: the unit every ZeRO stage moves and steps.

A ``FlatParam`` takes parameters of one optimizer group (a stage-1/2 bucket, or one
module's parameters in stage 3); ``fill`` copies them end to end into one padded buffer in
the compute dtype and points each parameter's ``.data`` at its slice of that buffer (the
``nn.Parameter`` objects the user holds stay the same). A parameter still on the meta
device (deferred initialization) is given its value by the caller as it is copied, so a
model is materialized one FlatParam at a time. The ranks of the group split the
buffer evenly (``FlatLayout``): rank r keeps

- ``shard``: its slice in the compute dtype; a view of the full buffer in stages 1-2, a
  tensor of its own in stage 3, where the full buffer's storage is freed between uses;
- ``master``: the fp32 values the optimizer steps; the shard itself when computing in fp32
  without offload (no copy exists), otherwise a separate fp32 tensor (on the host with
  offload); for a frozen FlatParam always the shard itself (below);
- gradients: the reduce-scatter of the flat gradient lands in ``shard.grad`` (compute
  dtype), or, with offload, is copied into the persistent fp32 host buffer ``master.grad``.

A ``replicated`` FlatParam (stage 0, plain data parallelism) is not split: its one "shard"
is the whole buffer on every rank, and its gradient is all-reduced instead. A ``frozen``
FlatParam holds parameters that take no gradient (``requires_grad=False``): it is sharded
and gathered like the others, but never reduced nor stepped, so it keeps its values in the
compute dtype only: its ``master`` is its shard (no fp32 copy under bf16/fp16, nothing on
the host with offload: nothing of it is ever stepped there), it never gets a gradient
buffer nor optimizer state. What it saves and exports is that compute-dtype value (the
value the model computes with; in fp32 nothing changes, the shard was the master already).

Collectives: ``start_reduce`` reduce-scatters the flat gradient (moves the padded buffer
once; a replicated one all-reduces it, moving it twice); ``gather_async`` all-gathers the
shard into the full buffer (moves it once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

import torch
from torch import Tensor, nn

from tessera.comm import (
    Group,
    Handle,
    all_gather,
    all_gather_async,
    all_reduce_async,
    group_rank,
    group_size,
    reduce_scatter_async,
)
from tessera.zero.flat import FlatLayout
from tessera.zero.offload import host_empty, host_zeros, to_device_, to_host_
from tessera.zero.pool import BufferPool

__all__ = ["FlatParam", "Residency"]


class Residency(Enum):
    """Whether the full buffer of a FlatParam is allocated and holds the parameters."""

    FREE = "free"
    GATHERING = "gathering"
    READY = "ready"


_MAX_SPARE = 2  # flat gradient buffers kept for reuse by one GradReducer's FlatParams


class FlatParam:
    """Parameters of one optimizer group flattened into one padded buffer, sharded over ``group``."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        *,
        group_index: int,
        group: Group,
        compute_dtype: torch.dtype,
        offload: bool,
        sharded: bool,
        replicated: bool = False,
        frozen: bool = False,
        align: int = 1,
        device: torch.device | None = None,
    ) -> None:
        if not params:
            raise ValueError("a FlatParam needs at least one parameter")
        if sharded and replicated:
            raise ValueError("a FlatParam is either sharded (stage 3) or replicated (stage 0), not both")
        self.params = list(params)
        self.names = list(names)
        self.group_index = group_index
        self.group = group
        self.replicated = replicated
        self.frozen = frozen
        ways = 1 if replicated else group_size(group)
        self.layout = FlatLayout(tuple(p.numel() for p in params), ways, align)
        self.shard_rank = 0 if replicated else group_rank(group)  # which shard of the layout is ours
        self.device = params[0].device if device is None else device
        self.compute_dtype = compute_dtype
        self.offload = offload
        self.sharded = sharded
        self.full = torch.empty(0, dtype=compute_dtype, device=self.device)  # until ``fill``
        self._full_out = self.full
        self.shard = nn.Parameter(self.full, requires_grad=False)
        self.master = self.shard
        self.filled = False
        self.has_grad = False
        self.residency = Residency.FREE
        self._gather: Handle[Tensor] | None = None
        self._reduce: tuple[Handle[Tensor], Tensor] | None = None
        self._grad_flat: Tensor | None = None  # the buffer the parameters' .grad views point into
        self._grad_buffer: Tensor | None = None  # stage 0: the flat gradient, reused every step
        self._reduce_input: Tensor | None = None  # stages 1-2: the buffer being reduce-scattered
        self.spare_buffers: list[Tensor] | None = None  # stages 1-2: a free list shared by flats
        self.spare_numel = 0  # the size of the buffers in that list (the largest flat's)
        self.ready_params = 0  # parameters whose gradient is final in the current backward
        self.launched = False  # whether the current backward has started this reduce
        self.pool: BufferPool | None = None  # stage 3: where freed memory waits for reuse
        self._pool_input: Tensor | None = None  # stage 3: a reduce's input, back to the pool after

    def fill(self, value: Callable[[int], Tensor] | None = None) -> None:
        """Copy the parameters into the flat buffer, keep this rank's shard (and a separate
        master where one exists: not for a frozen FlatParam), and point each parameter at its
        slice (stage 3: then release the full buffer). A
        parameter on the meta device takes ``value(i)``, the value of parameter ``i`` (any
        dtype and device), and becomes a real tensor in place (the same Python object);
        only this FlatParam's values exist at once."""
        if self.filled:
            raise RuntimeError(f"{self!r} is filled already")
        lo, hi = self.layout.shard_range(self.shard_rank)
        with torch.no_grad():
            source = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
            for i, p in enumerate(self.params):
                start, stop = self.layout.span(i)
                if p.is_meta:
                    if value is None:
                        raise ValueError(
                            f"{self.names[i]} is on the meta device and no value was given for it"
                        )
                    given = value(i)
                    if tuple(given.shape) != tuple(p.shape):
                        raise ValueError(
                            f"{self.names[i]}: the value given has shape {tuple(given.shape)}, "
                            f"the parameter {tuple(p.shape)}"
                        )
                    source[start:stop].copy_(given.reshape(-1))
                    del given
                else:
                    source[start:stop].copy_(p.detach().reshape(-1))
            full = source if self.compute_dtype == torch.float32 else source.to(self.compute_dtype)
            master: Tensor | None = None  # None: the shard is the master (fp32, or frozen)
            if self.frozen:  # never stepped: its compute-dtype shard is all it keeps
                master = None
            elif self.offload:
                master = host_empty(hi - lo)
                master.copy_(source[lo:hi])
            elif self.compute_dtype != torch.float32:
                master = source[lo:hi].clone()
            shard = full[lo:hi].clone() if self.sharded else full[lo:hi]
            del source
        self.full = full
        self._full_out = full.data  # an alias with its own version counter: writes through it
        # (the all-gather refilling freed parameters in stage 3) do not invalidate autograd's
        # saved references to the parameters
        for i, p in enumerate(self.params):
            start, stop = self.layout.span(i)
            view = full[start:stop].view(p.shape)
            if p.is_meta:  # its storage cannot be re-pointed: the tensors trade places instead
                real = nn.Parameter(view, requires_grad=p.requires_grad)
                # the swap trades the Python attributes too: keep the ones the meta parameter
                # carried (tensor parallelism's tags, e.g. a gradient partial over tp)
                real.__dict__.update(p.__dict__)
                torch.utils.swap_tensors(p, real)  # type: ignore[no-untyped-call]
            else:
                p.data = view
        self.shard = nn.Parameter(shard, requires_grad=False)
        self.master = self.shard if master is None else nn.Parameter(master, requires_grad=False)
        if self.offload and not self.frozen:
            self.master.grad = host_zeros(hi - lo)
        self.filled = True
        self.residency = Residency.READY
        if self.sharded:
            self.free()

    # ------------------------------------------------------------------ sizes
    @property
    def numel(self) -> int:
        """Parameter elements held (without padding)."""
        return self.layout.numel

    @property
    def padded_bytes(self) -> int:
        """Bytes of the full padded buffer in the compute dtype (what one collective moves)."""
        return self.layout.padded_numel * self.full.element_size()

    # ------------------------------------------------------------------ parameters
    def gather_async(self) -> None:
        """Start refilling the full buffer from every rank's shard (stage 3); no-op if there."""
        if self.residency is not Residency.FREE:
            return
        if self.pool is not None:
            self.pool.fill(self.full.untyped_storage(), self.padded_bytes)
        else:
            self.full.untyped_storage().resize_(self.padded_bytes)
        self._gather = all_gather_async(self.shard, self.group, out=self._full_out)
        self.residency = Residency.GATHERING

    def wait_gathered(self) -> None:
        """Make sure the full buffer holds the parameters (gathering them if needed)."""
        self.gather_async()
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self.residency = Residency.READY

    def free(self) -> None:
        """Release the full buffer's memory (stage 3); the parameters keep their shapes."""
        if not self.sharded or self.residency is Residency.FREE:
            return
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        if self.pool is not None:
            self.pool.release(self.full.untyped_storage())
        else:
            self.full.untyped_storage().resize_(0)
        self.residency = Residency.FREE

    def gather_params_async(self) -> Handle[Tensor]:
        """All-gather the updated shards into the persistent full buffer (stages 1-2), in place."""
        return all_gather_async(self.shard, self.group, out=self._full_out)

    def gather_full(self, shard: Tensor) -> Tensor:
        """The full flat buffer whose shard on this rank is ``shard`` (e.g. the master or its
        gradient), on this rank's device; all-gathered (collective) unless replicated."""
        local = shard.detach().to(self.device)
        return local if self.replicated else all_gather(local, self.group)

    def push_master(self) -> None:
        """Write the stepped fp32 master into the compute-dtype shard (a no-op when they are one)."""
        if self.master is self.shard:
            return
        if self.offload:
            to_device_(self.shard, self.master)
        else:
            with torch.no_grad():
                self.shard.copy_(self.master)

    # ------------------------------------------------------------------ gradients
    def prepare_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slice of one zeroed flat buffer, so autograd
        accumulates into it in place and the reduce needs no copy (stage 3, before a unit's
        backward); a no-op when gradients already exist, and for a frozen FlatParam."""
        if self.frozen or self._grad_flat is not None or any(p.grad is not None for p in self.params):
            return
        n = self.layout.padded_numel
        if self.pool is not None:
            buf = self.pool.zeros(n, self.compute_dtype, self.device)
        else:
            buf = torch.zeros(n, dtype=self.compute_dtype, device=self.device)
        for i, p in enumerate(self.params):
            start, stop = self.layout.span(i)
            p.grad = buf[start:stop].view(p.shape)
        self._grad_flat = buf

    def _in_place(self) -> bool:
        if self._grad_flat is None:
            return False
        ptr = self._grad_flat.untyped_storage().data_ptr()
        return all(p.grad is not None and p.grad.untyped_storage().data_ptr() == ptr for p in self.params)

    def start_reduce(self) -> None:
        """Gather the parameters' gradients (zeros where none) into one padded buffer (already
        there after ``prepare_grads``), release them, and start reduce-scattering it (sum; a
        replicated FlatParam all-reduces it in place)."""
        if self._reduce is not None:
            self.finish_reduce()
        pooled = False  # whether buf goes back to spare_buffers when the reduce is done
        if self._in_place():
            assert self._grad_flat is not None
            buf = self._grad_flat
            for p in self.params:
                p.grad = None
            if self.pool is not None:  # taken from the pool: back to it once reduced
                self._pool_input = buf
        else:
            buf, pooled = self._flat_grad_buffer()
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    start, stop = self.layout.span(i)
                    if p.grad is None:
                        buf[start:stop].zero_()
                    else:
                        buf[start:stop].copy_(p.grad.reshape(-1))
                        p.grad = None
                buf[self.layout.numel :].zero_()
        self._grad_flat = None
        if self.replicated:
            self._reduce = (all_reduce_async(buf, self.group, inplace=True), buf)
            return
        out = torch.empty(self.layout.shard_numel, dtype=self.compute_dtype, device=self.device)
        # The backend keeps its input alive until the collective completes; with a free list
        # (``spare_buffers``) the buffer is kept here too and handed back once the reduce is done.
        self._reduce = (reduce_scatter_async(buf, self.group, out=out), out)
        if not pooled:
            self._reduce_input = None

    def _flat_grad_buffer(self) -> tuple[Tensor, bool]:
        """Where the gradients are gathered for the reduce, and whether it is to be handed
        back to ``spare_buffers`` once reduced. A new buffer of the model's size each step
        costs its page faults on the CPU (see benchmarks/README.md, single-rank overhead), so
        stage 0 (replicated) keeps one from step to step, as DDP keeps its buckets (reused
        only when this FlatParam holds no reduced gradient: the last one has been consumed
        and released), and stages 1-2 take one of the right size from the free list that
        their ``GradReducer`` shares among its FlatParams (at most ``max_in_flight + 1``
        buffers: those the backend reads anyway)."""
        numel = self.layout.padded_numel

        def new(n: int) -> Tensor:
            return torch.empty(n, dtype=self.compute_dtype, device=self.device)

        if self.replicated:
            if not self.has_grad and self._grad_buffer is not None:
                return self._grad_buffer, False
            buf = new(numel)
            if not self.has_grad:
                self._grad_buffer = buf
            return buf, False
        spare = self.spare_buffers
        if spare is None or self.sharded:
            return new(numel), False
        fits = [k for k, b in enumerate(spare) if b.numel() >= numel and b.dtype == self.compute_dtype]
        if fits and spare[fits[0]].device == self.device:
            base = spare.pop(fits[0])  # by place: ``remove`` would compare tensors of other dtypes by value
        else:  # sized for the largest FlatParam sharing the list, so any of them can reuse it
            base = new(max(numel, self.spare_numel))
        self._reduce_input = base
        return base[:numel], True

    def reduce_done(self) -> bool:
        """Whether the reduce-scatter in flight has completed (so finishing it will not block)."""
        return self._reduce is not None and self._reduce[0].is_completed()

    def finish_reduce(self) -> None:
        """Wait for the reduction and add its result to this rank's gradient shard."""
        if self._reduce is None:
            return
        handle, _ = self._reduce
        reduced = handle.wait()
        self._reduce = None
        if self._reduce_input is not None:  # read by the backend until now: free to reuse
            assert self.spare_buffers is not None
            if len(self.spare_buffers) < _MAX_SPARE:
                self.spare_buffers.append(self._reduce_input)
            self._reduce_input = None
        if self._pool_input is not None:
            assert self.pool is not None
            self.pool.give(self._pool_input)
            self._pool_input = None
        if self.offload:
            assert self.master.grad is not None
            to_host_(self.master.grad, reduced, accumulate=self.has_grad)
        elif self.has_grad and self.shard.grad is not None:
            self.shard.grad.add_(reduced)
        else:
            self.shard.grad = reduced
        self.has_grad = True

    def reduce_output(self) -> Tensor | None:
        """The output of the reduction in flight (a shard; a replicated buffer), if any."""
        return None if self._reduce is None else self._reduce[1]

    def master_grad(self) -> Tensor:
        """The fp32 gradient of this rank's master shard, for the optimizer (summed over ranks,
        not yet averaged or unscaled)."""
        if not self.has_grad:
            raise RuntimeError("no gradient has been reduced into this shard yet; call backward first")
        if self.offload or self.master is self.shard:
            grad = self.master.grad
        else:
            assert self.shard.grad is not None
            grad = self.master.grad = self.shard.grad.float()
            self.shard.grad = None
        assert grad is not None
        return grad

    def release_grads(self) -> None:
        """Drop this shard's gradients (the offload host buffer is kept, marked empty)."""
        if self._reduce is not None:
            self.finish_reduce()
        if self._grad_flat is not None:
            for p in self.params:
                p.grad = None
            self._grad_flat = None
        self.shard.grad = None
        if not self.offload:
            self.master.grad = None
        self.has_grad = False

    def __repr__(self) -> str:
        return (
            f"FlatParam(group={'frozen' if self.frozen else self.group_index}, params={len(self.params)}, "
            f"numel={self.numel}, "
            f"padded={self.layout.padded_numel}, {self.compute_dtype}, {self.residency.value})"
        )
