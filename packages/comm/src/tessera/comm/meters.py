"""A meter of the bytes every Tessera collective and p2p call moves.

``with CommMeter() as m: ...`` records each call made *by this thread* inside the block
(threads and asyncio tasks each see their own meters, so a threaded process group meters
each rank separately). Nothing is recorded when no meter is open.

Two accountings are kept per call, both exact integers:

- ``volume_bytes``, the accounting of the ZeRO and Megatron papers: an all-reduce of S bytes
  moves 2S (a reduce-scatter then an all-gather); an all-gather moves its full output S, a
  reduce-scatter its full input S, an all-to-all its input, a broadcast, send or recv its
  buffer. DP moves 2 x parameter bytes per step, ZeRO-3 3 x, by this count.
- ``sent_bytes`` / ``recv_bytes``: what this rank puts on and takes off the wire in a
  bandwidth-optimal ring algorithm over n ranks: all-gather and reduce-scatter (n-1)/n of
  the full buffer each way; all-reduce twice that, on the buffer padded to a multiple of n
  elements; all-to-all everything but the chunk a rank keeps; broadcast S sent by the root
  and S received by every other rank; send and recv their buffer. A group of one moves 0.
"""

from __future__ import annotations

import contextvars
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType

from torch import Tensor

__all__ = ["CommMeter", "CommOp", "CommRecord", "record"]


class CommOp(StrEnum):
    """The kinds of communication a CommMeter tells apart."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One call: its kind, group size, the bytes it moves by both accountings, and its dtype."""

    op: CommOp
    group_size: int
    volume_bytes: int
    sent_bytes: int
    recv_bytes: int
    dtype: str


_ACTIVE: contextvars.ContextVar[tuple[CommMeter, ...]] = contextvars.ContextVar(
    "tessera_comm_meters", default=()
)


@dataclass
class CommMeter:
    """Records every Tessera collective and p2p call made in this thread while open."""

    records: list[CommRecord] = field(default_factory=list)
    _token: contextvars.Token[tuple[CommMeter, ...]] | None = field(default=None, repr=False)

    def __enter__(self) -> CommMeter:
        self._token = _ACTIVE.set((*_ACTIVE.get(), self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._token is not None, "CommMeter exited without being entered"
        _ACTIVE.reset(self._token)
        self._token = None

    @property
    def volume_bytes(self) -> int:
        """Total bytes moved by the paper accounting (all-reduce counts 2x its buffer)."""
        return sum(r.volume_bytes for r in self.records)

    @property
    def sent_bytes(self) -> int:
        """Total bytes this rank sent (ring algorithms)."""
        return sum(r.sent_bytes for r in self.records)

    @property
    def recv_bytes(self) -> int:
        """Total bytes this rank received (ring algorithms)."""
        return sum(r.recv_bytes for r in self.records)

    def by_op(self) -> dict[CommOp, int]:
        """``volume_bytes`` summed per kind of call."""
        out: dict[CommOp, int] = defaultdict(int)
        for r in self.records:
            out[r.op] += r.volume_bytes
        return dict(out)

    def count(self, op: CommOp | None = None) -> int:
        """How many calls (of one kind, or all) were recorded."""
        return sum(1 for r in self.records if op is None or r.op is op)


def _ring(total_bytes: int, n: int) -> int:
    return total_bytes * (n - 1) // n


def record(
    op: CommOp,
    *,
    group_size: int,
    nbytes: int,
    like: Tensor,
    is_root: bool = False,
    kept_bytes: int = 0,
    out_bytes: int | None = None,
) -> None:
    """Tell every open meter of this thread about one call moving a buffer of ``nbytes``.

    ``nbytes`` is the full buffer as defined by the op (all-gather: output; reduce-scatter
    and all-to-all: input). ``kept_bytes`` is the all-to-all chunk a rank keeps, ``out_bytes``
    the all-to-all output, ``is_root`` whether this rank is the broadcast source, ``like`` a
    tensor of the dtype moved.
    """
    meters = _ACTIVE.get()
    if not meters:
        return
    elem_size, dtype = like.element_size(), str(like.dtype).removeprefix("torch.")
    n = group_size
    sent = recv = 0
    volume = nbytes
    if op is CommOp.ALL_REDUCE:
        volume = 2 * nbytes
        numel = nbytes // elem_size
        padded = -(-numel // n) * n * elem_size
        sent = recv = 2 * _ring(padded, n)
    elif op in (CommOp.ALL_GATHER, CommOp.REDUCE_SCATTER):
        sent = recv = _ring(nbytes, n)
    elif op is CommOp.ALL_TO_ALL:
        sent = nbytes - kept_bytes
        recv = (nbytes if out_bytes is None else out_bytes) - kept_bytes
    elif op is CommOp.BROADCAST:
        sent, recv = (nbytes, 0) if is_root else (0, nbytes)
    elif op is CommOp.SEND:
        sent = nbytes
    else:
        recv = nbytes
    if n == 1:
        volume = sent = recv = 0
    rec = CommRecord(op, n, volume, sent if n > 1 else 0, recv if n > 1 else 0, dtype)
    for meter in meters:
        meter.records.append(rec)
