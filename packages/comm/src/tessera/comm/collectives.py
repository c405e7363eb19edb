"""Typed collectives over a process group, each recorded by any open CommMeter.

Every function takes the group explicitly (``None`` means the default world group), never
mutates its input, and returns a new tensor; ``*_async`` forms return a Handle whose
``wait()`` gives that tensor. A group of one rank returns without communicating.
Tensors must be on the device the group's backend serves (cpu for gloo, cuda for NCCL).

After an ``*_async`` call returns, the caller may drop its input: the call keeps alive what
it still reads. It must not modify the input, nor touch an ``out=`` buffer, before
``wait()``.

On CPU tensors of a gloo group whose ranks share a host, every collective here runs through
shared memory (``tessera.comm.shm``). On other gloo groups ``reduce_scatter`` and
``all_gather`` run Tessera's own ring over p2p (``tessera.comm.gloo_ring``: half the traffic
of torch's gloo reduce-scatter, which all-reduces a copy, and no extra copies); both are
ordered per group on its lane. Elsewhere torch's collectives run.

Waiting for a collective on CPU tensors first polls its completion for a bounded time,
yielding the core between polls, then blocks (``tessera.comm.waiting``: a parked core is
slow to wake on a virtual machine; ``TESSERA_POLL_WAIT_MS`` sets or turns off the poll).
Point-to-point on CPU tensors (`tessera.comm.p2p`) reports completion as it happens, so its
waits poll too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import gloo_ring, shm
from tessera.comm.eager import never_compiled
from tessera.comm.meters import CommOp, record
from tessera.comm.profiling import WAIT, profiled, profiler_enabled
from tessera.comm.waiting import poll_budget, poll_then_wait

__all__ = [
    "Group",
    "Handle",
    "ReduceOpName",
    "all_gather",
    "all_gather_async",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_rows",
    "broadcast",
    "broadcast_async",
    "group_rank",
    "group_size",
    "overlappable",
    "reduce_scatter",
    "reduce_scatter_async",
]

Group = dist.ProcessGroup | None
ReduceOpName = Literal["sum", "avg", "max", "min"]
T = TypeVar("T")

_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class Waitable(Protocol):
    """Anything that can be waited on: a torch Work, or another Handle."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class Handle(Generic[T]):
    """An operation in flight; ``wait()`` blocks until it completes and returns its result."""

    __slots__ = ("_done", "_finish", "_poll_s", "_result", "_wait_name", "_works")

    def __init__(
        self,
        works: list[Waitable],
        finish: Callable[[], T],
        *,
        wait_name: str = WAIT,
        poll_s: float = 0.0,
    ) -> None:
        self._works = works
        self._finish = finish
        self._done = False
        self._result: T | None = None
        self._wait_name = wait_name  # the profiler range of wait(): see tessera.comm.profiling
        self._poll_s = poll_s  # how long wait() polls before it blocks: tessera.comm.waiting

    @never_compiled
    def wait(self) -> T:
        """Wait for completion (idempotent) and return the result."""
        if not self._done:
            if self._works and profiler_enabled():
                with torch.autograd.profiler.record_function(self._wait_name):
                    self._complete()
            else:
                self._complete()
        return cast(T, self._result)  # set by _complete(); None only when T admits it

    def _complete(self) -> None:
        poll_then_wait(self._works, self._poll_s)
        self._result = self._finish()
        self._done = True

    def is_completed(self) -> bool:
        """Whether every underlying operation has finished (the result may still need wait()).

        True once ``wait()`` has returned. Before that, a backend may report completion late
        (torch's gloo p2p works only do when waited on; Tessera's CPU p2p avoids them). The
        gloo rings and CPU p2p report truthfully as soon as they finish. Poll it as a hint,
        never as the only way to learn that a transfer is done.
        """
        return self._done or all(w.is_completed() for w in self._works)


def group_size(group: Group) -> int:
    """The number of ranks in ``group``."""
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index inside ``group``."""
    return dist.get_rank(group)


@never_compiled  # a question about the group, answered eagerly (it may set up shared memory)
def overlappable(x: Tensor, group: Group) -> bool:
    """Whether an ``*_async`` collective of tensors like ``x`` on ``group`` proceeds while the
    caller computes. Not on one rank, nor where the ranks share memory (`tessera.comm.shm`:
    the collective runs within the call, and faster than any overlap could hide), so code
    that reorders work to overlap communication can keep its plain order there. On its
    group's first call it may set up the shared memory, so call it on every rank alike."""
    return group_size(group) > 1 and shm.applies(x, group) is None


def _reduce_op(op: str) -> dist.ReduceOp.RedOpType:
    if op not in _OPS:
        raise ValueError(f"reduce op must be one of {sorted(_OPS)}, got {op!r}")
    return _OPS[op]


def _check_divisible(x: Tensor, dim: int, n: int, what: str) -> int:
    if x.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension, got a scalar")
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) is not divisible "
            f"by the group size {n}"
        )
    return dim


def _done(result: T) -> Handle[T]:
    return Handle([], lambda: result)


def _all_reduce(x: Tensor, group: Group, op: ReduceOpName, inplace: bool, async_op: bool) -> Handle[Tensor]:
    red = _reduce_op(op)
    n = group_size(group)
    if inplace and not x.is_contiguous():
        raise ValueError(f"all_reduce(inplace=True) needs a contiguous tensor, got strides {x.stride()}")
    result = x if inplace else x.detach().clone(memory_format=torch.contiguous_format)
    if n == 1:
        return _done(result)
    buffer = result.detach()
    record(CommOp.ALL_REDUCE, group_size=n, nbytes=buffer.nbytes, like=buffer)
    segment = shm.applies(buffer, group)
    if segment is not None:
        return _in_shared_memory(group, async_op, result, shm.all_reduce, segment, buffer, op)
    work = dist.all_reduce(buffer, op=red, group=group, async_op=True)

    def finish() -> Tensor:
        if op == "avg":
            buffer.div_(n)
        return result

    return Handle([work], finish, poll_s=poll_budget(buffer.device))


@never_compiled
@profiled("tessera.comm.all_reduce_async")
def all_reduce_async(
    x: Tensor, group: Group = None, op: ReduceOpName = "sum", *, inplace: bool = False
) -> Handle[Tensor]:
    """Start reducing ``x`` over the group: every rank gets the sum (avg, max, min); moves 2x x.

    With ``inplace=True`` the result is written into ``x`` itself (which must be contiguous)
    instead of a new tensor.
    """
    return _all_reduce(x, group, op, inplace, async_op=True)


@never_compiled
@profiled("tessera.comm.all_reduce")
def all_reduce(x: Tensor, group: Group = None, op: ReduceOpName = "sum", *, inplace: bool = False) -> Tensor:
    """Reduce ``x`` over the group (sum by default) and return the result on every rank."""
    return _all_reduce(x, group, op, inplace, async_op=False).wait()


def _check_out(out: Tensor, shape: tuple[int, ...], like: Tensor, what: str) -> None:
    if tuple(out.shape) != shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(
            f"{what}: out must be a contiguous {like.dtype} tensor of shape {shape}, got "
            f"{out.dtype} {tuple(out.shape)} (contiguous={out.is_contiguous()})"
        )


def _on_lane(group: Group, fn: Callable[[], Tensor], async_op: bool) -> Handle[Tensor]:
    """Run ``fn`` (a gloo ring or a shared-memory collective) after the group's earlier ones:
    async on the group's lane thread, else in this thread; a Handle that completes when it has."""
    if not async_op:
        return _done(gloo_ring.run(group, fn))
    future = gloo_ring.submit(group, fn)
    return Handle([gloo_ring.FutureWork(future)], future.result, poll_s=poll_budget(torch.device("cpu")))


def _in_shared_memory(
    group: Group, async_op: bool, result: Tensor, fn: Callable[..., None], *args: Any
) -> Handle[Tensor]:
    """Run the shared-memory collective ``fn(*args)`` in order on the group's lane
    (`_on_lane`); the handle gives ``result``, which ``fn`` fills."""

    def run() -> Tensor:
        fn(*args)
        return result

    return _on_lane(group, run, async_op)


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _all_gather(x: Tensor, group: Group, dim: int, out: Tensor | None, async_op: bool) -> Handle[Tensor]:
    n = group_size(group)
    if x.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension, got a scalar")
    dim = dim % x.dim()
    src = x.detach().contiguous()
    shape = (n * src.shape[0], *src.shape[1:])
    if out is not None:
        if dim != 0:
            raise ValueError(f"all_gather: out= is supported for dim 0 only, got dim {dim}")
        _check_out(out, shape, src, "all_gather")
    if n == 1:
        return _done(out.copy_(src) if out is not None else src.clone())
    flat = out.detach() if out is not None else torch.empty(shape, dtype=src.dtype, device=src.device)
    record(CommOp.ALL_GATHER, group_size=n, nbytes=flat.nbytes, like=src)

    def finish() -> Tensor:
        if dim == 0:
            return out if out is not None else flat
        return torch.cat(flat.view(n, *src.shape).unbind(0), dim=dim)

    segment = shm.applies(src, group)
    if segment is not None or gloo_ring.applies(src, group):
        if _shares_memory(src, flat):
            src = src.clone()

        def ring() -> Tensor:
            if segment is not None:
                shm.all_gather(segment, src, flat)
            else:
                gloo_ring.ring_all_gather(src, flat, group)
            return finish()

        return _on_lane(group, ring, async_op)
    work = dist.all_gather_single(flat, src, group=group, async_op=True)
    return Handle([work], finish, poll_s=poll_budget(flat.device))


@never_compiled
@profiled("tessera.comm.all_gather_async")
def all_gather_async(
    x: Tensor, group: Group = None, dim: int = 0, *, out: Tensor | None = None
) -> Handle[Tensor]:
    """Start concatenating every rank's ``x`` along ``dim`` in rank order; moves the output.

    ``out`` (dim 0 only): a preallocated contiguous result to gather into.
    """
    return _all_gather(x, group, dim, out, async_op=True)


@never_compiled
@profiled("tessera.comm.all_gather")
def all_gather(x: Tensor, group: Group = None, dim: int = 0, *, out: Tensor | None = None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    return _all_gather(x, group, dim, out, async_op=False).wait()


def _reduce_scatter(
    x: Tensor, group: Group, dim: int, op: ReduceOpName, out: Tensor | None, async_op: bool
) -> Handle[Tensor]:
    red = _reduce_op(op)
    n = group_size(group)
    dim = _check_divisible(x, dim, n, "reduce_scatter")
    chunks = x.detach().chunk(n, dim=dim)
    if out is not None:
        _check_out(out, tuple(chunks[0].shape), x, "reduce_scatter")
    if n == 1:
        result = x.detach().clone(memory_format=torch.contiguous_format)
        return _done(out.copy_(result) if out is not None else result)
    if out is None:
        out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
    segment = shm.applies(x, group)
    if segment is not None or gloo_ring.applies(x, group):
        record(CommOp.REDUCE_SCATTER, group_size=n, nbytes=x.nbytes, like=x)
        result = out
        # the output is written while the input is still read: keep them apart
        dest = torch.empty_like(out) if _shares_memory(out, x) else out.detach()

        def ring() -> Tensor:
            if segment is not None:
                shm.reduce_scatter(segment, chunks, dest, op)
            else:
                gloo_ring.ring_reduce_scatter(chunks, dest, group, op)
            if dest is not result:
                result.detach().copy_(dest)
            return result

        return _on_lane(group, ring, async_op)
    src = torch.cat(chunks, 0) if dim != 0 else x.detach()
    record(CommOp.REDUCE_SCATTER, group_size=n, nbytes=src.nbytes, like=src)
    work = dist.reduce_scatter_single(out, src.contiguous(), op=red, group=group, async_op=True)
    poll_s = poll_budget(out.device)
    if op == "avg":
        return Handle([work], lambda: out.div_(n), poll_s=poll_s)
    return Handle([work], lambda: out, poll_s=poll_s)


@never_compiled
@profiled("tessera.comm.reduce_scatter_async")
def reduce_scatter_async(
    x: Tensor,
    group: Group = None,
    dim: int = 0,
    op: ReduceOpName = "sum",
    *,
    out: Tensor | None = None,
) -> Handle[Tensor]:
    """Start reducing ``x`` over the group, rank i keeping chunk i along ``dim``; moves the input.

    ``out``: a preallocated contiguous tensor of the chunk's shape to receive the result.
    """
    return _reduce_scatter(x, group, dim, op, out, async_op=True)


@never_compiled
@profiled("tessera.comm.reduce_scatter")
def reduce_scatter(
    x: Tensor, group: Group = None, dim: int = 0, op: ReduceOpName = "sum", *, out: Tensor | None = None
) -> Tensor:
    """Reduce ``x`` over the group and keep this rank's chunk along ``dim``."""
    return _reduce_scatter(x, group, dim, op, out, async_op=False).wait()


@never_compiled
@profiled("tessera.comm.all_to_all")
def all_to_all(x: Tensor, group: Group = None, scatter_dim: int = 0, gather_dim: int = 0) -> Tensor:
    """Send chunk j of ``x`` (split along ``scatter_dim``) to rank j; concatenate what arrives
    along ``gather_dim`` in rank order. Moves the input, less the chunk a rank keeps."""
    n = group_size(group)
    scatter_dim = _check_divisible(x, scatter_dim, n, "all_to_all")
    gather_dim = gather_dim % x.dim()
    if n == 1:
        return x.detach().clone(memory_format=torch.contiguous_format)
    src = torch.stack(x.detach().chunk(n, dim=scatter_dim), 0).contiguous()
    out = torch.empty_like(src)
    record(CommOp.ALL_TO_ALL, group_size=n, nbytes=src.nbytes, kept_bytes=src.nbytes // n, like=src)
    segment = shm.applies(src, group)
    if segment is not None:
        _in_shared_memory(group, False, out, shm.all_to_all, segment, src, out)
    else:
        work = dist.all_to_all_single(out, src, group=group, async_op=True)
        poll_then_wait([work], poll_budget(src.device))
    return torch.cat(out.unbind(0), dim=gather_dim)


def _check_rows(rows: Sequence[int], n: int, what: str) -> list[int]:
    rows = [int(r) for r in rows]
    if len(rows) != n or min(rows, default=0) < 0:
        raise ValueError(f"all_to_all_rows: {what} must be {n} counts >= 0 (one per rank), got {rows}")
    return rows


@never_compiled
@profiled("tessera.comm.all_to_all_rows")
def all_to_all_rows(
    x: Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], group: Group = None
) -> Tensor:
    """Send the next ``send_rows[j]`` rows of ``x`` (dim 0, in order) to rank j; return the
    ``recv_rows[j]`` rows from each rank j concatenated in rank order (uneven all-to-all).

    Every rank's ``recv_rows[j]`` must equal rank j's ``send_rows`` for it (exchange the
    counts first, e.g. with `all_to_all`). Moves the input, less the rows a rank keeps.
    Runs torch's ``all_to_all_single`` with splits (gloo's TCP even between processes that
    share a host: the shared-memory segment has no uneven form).
    """
    n = group_size(group)
    send, recv = _check_rows(send_rows, n, "send_rows"), _check_rows(recv_rows, n, "recv_rows")
    if x.dim() == 0 or sum(send) != x.shape[0]:
        raise ValueError(
            f"all_to_all_rows: send_rows {send} must sum to the rows of x (shape {tuple(x.shape)})"
        )
    src = x.detach().contiguous()
    out = src.new_empty((sum(recv), *src.shape[1:]))
    if n == 1:
        return out.copy_(src)
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    me = group_rank(group)
    record(
        CommOp.ALL_TO_ALL,
        group_size=n,
        nbytes=src.nbytes,
        kept_bytes=send[me] * row_bytes,
        out_bytes=out.nbytes,
        like=src,
    )
    work = dist.all_to_all_single(out, src, recv, send, group=group, async_op=True)
    poll_then_wait([work], poll_budget(src.device))
    return out


def _broadcast(x: Tensor, src: int, group: Group, async_op: bool) -> Handle[Tensor]:
    n = group_size(group)
    if not 0 <= src < n:
        raise ValueError(f"broadcast source {src} is outside the group of {n} ranks")
    if n == 1:
        return _done(x.detach().clone(memory_format=torch.contiguous_format))
    me = group_rank(group)
    # the root sends a copy of x; every other rank's buffer is overwritten whole, so its x
    # is not copied first (SUMMA issues q broadcasts per Linear and pass)
    out = (
        x.detach().clone(memory_format=torch.contiguous_format)
        if me == src
        else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    record(CommOp.BROADCAST, group_size=n, nbytes=out.nbytes, is_root=me == src, like=out)
    segment = shm.applies(out, group)
    if segment is not None:
        return _in_shared_memory(group, async_op, out, shm.broadcast, segment, out, src)
    global_src = src if group is None else dist.get_global_rank(group, src)
    work = dist.broadcast(out, src=global_src, group=group, async_op=True)
    return Handle([work], lambda: out, poll_s=poll_budget(out.device))


@never_compiled
@profiled("tessera.comm.broadcast_async")
def broadcast_async(x: Tensor, src: int, group: Group = None) -> Handle[Tensor]:
    """Start sending the group rank ``src``'s ``x`` to every rank (shapes and dtypes must
    agree); ``wait()`` gives a new tensor holding it. Moves ``x`` (sent by the root)."""
    return _broadcast(x, src, group, async_op=True)


@never_compiled
@profiled("tessera.comm.broadcast")
def broadcast(x: Tensor, src: int, group: Group = None) -> Tensor:
    """Return the group rank ``src``'s ``x`` on every rank (shapes and dtypes must agree)."""
    return _broadcast(x, src, group, async_op=False).wait()
