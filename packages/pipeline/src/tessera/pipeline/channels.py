"""The runtime's p2p plumbing: ordered inboxes, shape headers, and the abort channel.

**Ordered inboxes.** Between two ranks, tensors are matched in the order they were posted
(gloo matches a source's messages in order, NCCL in stream order; tessera.comm's p2p has no
tags). A rank may need the messages of one peer in another order than the peer sends them
(interleaved and V schedules send activations and gradients for several stages over one
pair). So each `Inbox` receives one peer's messages strictly in the peer's send order,
which the schedule fixes, and keeps the ones that arrive before they are needed. This never
waits for more than the schedule does: a message sent before the needed one was issued
before it, and sends never block.

**Shapes, once per step.** Before its first activation of a step for a stage boundary, the
sender sends a small int64 header (dtype code, rank, sizes). The receiver decodes it and
allocates the buffers of that boundary's activations (microbatches have equal shapes).
Gradients need no header: the gradient of a stage's output has the shape of that output,
which the receiving rank computed itself.

**Abort channel.** A failing rank writes ``"tessera/pipeline/abort/<group>/<runtime>"`` to
the default c10d store (its rank, the step and the error). Every wait looks at that key every
few milliseconds; when it is set the wait raises `PipelineAborted`, so an error on one rank
ends the step on every rank instead of hanging it.

**Waiting.** Every wait polls the transfer's ``is_completed()`` (tessera.comm's p2p handles
report completion as it happens: on the CPU through shared memory between ranks of one host
(the runtime calls ``share_memory``) or over gloo links between hosts; NCCL's events on a
GPU) and looks at the abort key every few milliseconds. For the first
`tessera.comm.waiting.poll_budget` seconds of a wait it yields the core between polls
(a parked core is slow to wake on a virtual machine), then it sleeps between polls, at most
half a millisecond at a time.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import Group, Handle, batch_isend_irecv
from tessera.comm.profiling import P2P_WAIT, annotate
from tessera.comm.waiting import poll_budget

__all__ = [
    "HEADER_SIZE",
    "Inbox",
    "Message",
    "PipelineAborted",
    "Watch",
    "decode_header",
    "encode_header",
]

logger = logging.getLogger(__name__)

Transfer = Handle[list[Tensor]]
Message = tuple[str, int, int]
"""``("F" | "B", microbatch, sending stage)`` as `Action.message`, or ``("H", 0, stage)``: the
shape header of the boundary ``stage -> stage + 1``."""
Meta = tuple[tuple[int, ...], torch.dtype]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_DIMS = 8
HEADER_SIZE = 2 + _MAX_DIMS
_HEADER_META: Meta = ((HEADER_SIZE,), torch.int64)
_CHECK_EVERY_S = 0.005
_MAX_SLEEP_S = 0.0005


class PipelineAborted(RuntimeError):
    """Raised on every rank of a pipeline step that another rank's error ended."""


def encode_header(x: Tensor) -> Tensor:
    """The int64 header that announces activations shaped and typed like ``x``."""
    if x.dtype not in _DTYPES:
        raise TypeError(
            f"activations passed between pipeline stages must be floating point (one of "
            f"{[str(d) for d in _DTYPES]}) so gradients can flow back; got {x.dtype}"
        )
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"activations have {x.dim()} dims; at most {_MAX_DIMS} are supported")
    sizes = [*x.shape, *([-1] * (_MAX_DIMS - x.dim()))]
    return torch.tensor([_DTYPES.index(x.dtype), x.dim(), *sizes], dtype=torch.int64, device=x.device)


def decode_header(header: Tensor) -> Meta:
    """The (shape, dtype) a header announces."""
    code, ndim, *sizes = header.tolist()
    return tuple(sizes[:ndim]), _DTYPES[code]


class Watch:
    """Polled waits that notice another rank's failure; one per runtime."""

    def __init__(self, group: Group, timeout_s: float, device: torch.device) -> None:
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.poll_s = poll_budget(device)
        self.step = 0
        self._store: Any = None
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # pragma: no cover - every init_process_group has a store
            logger.warning("no default c10d store: a failing rank may hang the others")
        # Name this runtime without communicating: every rank builds the runtimes of a group
        # in the same order, so the n-th one built on each rank is the same runtime.
        ranks = ",".join(map(str, dist.get_process_group_ranks(group or dist.group.WORLD)))
        counter = f"tessera/pipeline/runtimes/{ranks}/{dist.get_rank()}"
        n = int(self._store.add(counter, 1)) if self._store is not None else 0
        self.key = f"tessera/pipeline/abort/{ranks}/{n}"

    def signal(self, exc: BaseException) -> None:
        """Tell every rank that this rank failed the current step with ``exc``."""
        if self._store is None:
            return
        try:
            message = f"rank {self.rank} raised {type(exc).__name__} in step {self.step}: {exc}"
            self._store.set(self.key, message)
        except Exception:  # pragma: no cover - the store itself is gone
            logger.exception("could not publish the pipeline abort")

    def check(self) -> None:
        """Raise `PipelineAborted` if another rank failed this step or an earlier one.

        An earlier one counts too: a rank may fail after the others finished that step, and
        a runtime that failed never steps again, so its peers would wait for it forever.
        """
        if self._store is not None and self._store.check([self.key]):
            message = self._store.get(self.key).decode(errors="replace")
            raise PipelineAborted(f"pipeline step {self.step} aborted: {message}")

    def wait(self, transfer: Transfer, what: str) -> list[Tensor]:
        """Wait for ``transfer`` while watching the abort key and the timeout."""
        if transfer.is_completed():
            return transfer.wait()
        with annotate(P2P_WAIT):  # the step breakdown's idle time: waiting on the peer
            return self._wait(transfer, what)

    def _wait(self, transfer: Transfer, what: str) -> list[Tensor]:
        start = time.monotonic()
        spin_until, check_at, delay = start + self.poll_s, start + _CHECK_EVERY_S, 2e-5
        while not transfer.is_completed():
            now = time.monotonic()
            if now >= check_at:
                self.check()
                if now - start > self.timeout_s:
                    raise TimeoutError(f"pipeline: waited {self.timeout_s:.0f} s for {what}")
                check_at = now + _CHECK_EVERY_S
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(2 * delay, _MAX_SLEEP_S)
        return transfer.wait()


class Inbox:
    """Receives one peer's messages in the peer's send order (see the module docstring)."""

    def __init__(
        self,
        peer: int,
        order: Sequence[Message],
        group: Group,
        device: torch.device,
        watch: Watch,
        grad_meta: Callable[[int, int], Meta | None],
        depth: int = 2,
    ) -> None:
        self.peer = peer
        self.order = tuple(order)
        self.group = group
        self.device = device
        self.watch = watch
        self.grad_meta = grad_meta
        self.depth = depth
        self.reset()

    def reset(self) -> None:
        """Forget the previous step (its messages were all received)."""
        self._next = 0
        self._in_flight: deque[tuple[Message, Transfer]] = deque()
        self._arrived: dict[Message, Tensor] = {}
        self._shapes: dict[int, Meta] = {}

    def _meta(self, msg: Message) -> Meta | None:
        kind, mb, stage = msg
        if kind == "H":
            return _HEADER_META
        if kind == "F":
            return self._shapes.get(stage)
        return self.grad_meta(mb, stage - 1)

    def _post(self) -> bool:
        if self._next >= len(self.order):
            return False
        msg = self.order[self._next]
        meta = self._meta(msg)
        if meta is None:
            return False
        buffer = torch.empty(meta[0], dtype=meta[1], device=self.device)
        self._in_flight.append((msg, batch_isend_irecv([], [(buffer, self.peer)], self.group)))
        self._next += 1
        return True

    def _land(self, block: bool) -> bool:
        msg, transfer = self._in_flight[0]
        if not block and not transfer.is_completed():
            return False
        (tensor,) = self.watch.wait(transfer, f"{msg} from rank {self.peer}")
        self._in_flight.popleft()
        if msg[0] == "H":
            self._shapes[msg[2]] = decode_header(tensor)
        else:
            self._arrived[msg] = tensor
        return True

    def prefetch(self) -> None:
        """Land what has arrived and post the next receives whose shapes are known."""
        while self._in_flight and self._land(block=False):
            pass
        while len(self._in_flight) < self.depth and self._post():
            pass

    def check_done(self) -> None:
        """Raise if this step left messages of the peer unreceived or unused (a runtime bug)."""
        if self._next < len(self.order) or self._in_flight or self._arrived:
            raise RuntimeError(
                f"pipeline: the step ended with messages from rank {self.peer} unused: "
                f"{sorted(self._arrived)} arrived, {len(self._in_flight)} in flight, "
                f"{len(self.order) - self._next} not posted"
            )

    def get(self, msg: Message) -> Tensor:
        """Wait for ``msg`` (landing the peer's earlier messages on the way) and return it."""
        while msg not in self._arrived:
            while len(self._in_flight) < self.depth and self._post():
                pass
            if not self._in_flight:
                raise RuntimeError(
                    f"pipeline: cannot receive {msg} from rank {self.peer}: the next message "
                    f"{self.order[self._next] if self._next < len(self.order) else None} has no "
                    "known shape, or the peer sends no such message (schedule mismatch)"
                )
            self._land(block=True)
        tensor = self._arrived.pop(msg)
        self.prefetch()
        return tensor
