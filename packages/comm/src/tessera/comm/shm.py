"""CPU collectives among the ranks of one host through a shared-memory segment.

Gloo moves CPU tensors between processes over TCP, even on one host: every byte is copied
into the kernel and out again, and each collective costs a few hundred microseconds of
system calls and wake-ups before any byte moves. Ranks that share a host can instead
exchange tensors through memory they all map, as the shared-memory transports of NCCL and
of DeepSpeed's CPU collectives do. Here each group of such ranks maps one segment:

- a row of *arrive* and a row of *leave* counters, one per rank, each on its own cache line;
- two sets (by the parity of the operation's number) of one slot per rank.

Operation ``s`` of a group (every rank numbers its group's operations alike, because every
rank calls the group's collectives in the same order) goes: wait until every rank has left
operation ``s - 2`` (the last user of this parity's slots); copy this rank's piece into its
slot; set its arrive counter to ``s``; wait until every rank has arrived; read the slots it
needs (a reduction adds them in rank order, so every rank computes the same bits); set its
leave counter to ``s``. Tensors larger than a slot go piece by piece. The ordering relies on
x86's total store order (a counter is written after the data it announces, and read before
it), so the segment is used on x86-64 Linux only.

Collectives run where gloo's rings would (`tessera.comm.gloo_ring`): a blocking one in the
caller's thread, an async one on its group's lane thread, in call order. A waiting caller
polls the counters, yielding the core for the first `tessera.comm.waiting.poll_budget`
seconds; after that (and on a lane thread at once) it sleeps in the kernel on the *bell* of
a rank it waits for (a 32-bit word each rank bumps after every counter it sets, and wakes
the word's sleepers: a futex on the shared page), so a host with more ranks than cores
wakes a rank when its peer arrives rather than when a timer fires. Every
50 ms it checks that its peers' processes are alive (a dead peer raises at once, naming it)
and the group's timeout.

A group's segment is set up at its first eligible collective, collectively: the ranks
compare host identities through the default store; if they all match, group rank 0 creates
a file in ``/dev/shm`` and every rank maps it and checks a token in it; the last rank to map
it unlinks it. If any rank cannot, the group keeps gloo. ``TESSERA_SHM=0`` turns this off
(`tessera.comm.shm_env`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm.gloo_ring import on_lane
from tessera.comm.shm_env import enabled_from_env
from tessera.comm.shm_sizes import LINE_BYTES, SLOTS_BYTES
from tessera.comm.waiting import poll_budget

__all__ = [
    "SLOTS_BYTES",
    "SUPPORTED",
    "Segment",
    "SegmentError",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "applies",
    "broadcast",
    "local_segment",
    "reduce_scatter",
]

logger = logging.getLogger(__name__)

# SLOTS_BYTES: bytes of slots per segment (both parities, every rank), and LINE_BYTES (one
# counter per cache line), from shm_sizes (torch-free)
_LINE = LINE_BYTES
_CHECK_S = 0.05  # how often a wait checks its peers and the timeout
_SYS_FUTEX = 202  # x86-64's futex system call
FUTEX_WAIT, FUTEX_WAKE, WAKE_ALL = 0, 1, 2**31 - 1  # shared (not private): across processes
SHM_DIR = Path("/dev/shm")
_CPU = torch.device("cpu")
_COMBINE: dict[str, Callable[..., Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def timespec(seconds: float) -> _Timespec:
    seconds = max(seconds, 1e-6)
    return _Timespec(int(seconds), int((seconds % 1) * 1e9))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def futex(address: int, op: int, value: int, timeout: _Timespec | None) -> None:
    """FUTEX_WAIT (sleep while the word at ``address`` equals ``value``, at most ``timeout``)
    or FUTEX_WAKE (wake up to ``value`` sleepers) on a word of shared memory."""
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(op),
        ctypes.c_int(value),
        None if timeout is None else ctypes.byref(timeout),
        None,
        ctypes.c_int(0),
    )


class SegmentError(RuntimeError):
    """A shared-memory collective failed: a peer died, or the group's timeout passed."""


class Segment:
    """One group's shared memory on this rank: counters, slots, and the operation number."""

    def __init__(self, buf: mmap.mmap, n: int, me: int, pids: Sequence[int], timeout_s: float) -> None:
        self.n, self.me = n, me
        self.pids = tuple(pids)
        self.timeout_s = timeout_s
        header = 2 * n * _LINE
        self.slot_bytes = (SLOTS_BYTES // (2 * n)) // _LINE * _LINE
        counters = np.frombuffer(buf, dtype=np.int64, count=header // 8).reshape(2, n, _LINE // 8)
        self.arrive, self.leave = counters[0, :, 0], counters[1, :, 0]
        # each rank's bell: a 32-bit word on its arrive line, bumped after each counter change
        self.bells = counters.view(np.int32).reshape(2, n, _LINE // 4)[0, :, 2]
        base = counters.ctypes.data
        self._bell_addresses = [base + q * _LINE + 8 for q in range(n)]
        data = torch.frombuffer(buf, dtype=torch.uint8, offset=header, count=2 * n * self.slot_bytes)
        self.slots = data.view(2, n, self.slot_bytes)
        self._buf = buf
        self.seq = int(self.leave[me])
        self.broken: str | None = None
        self._views: dict[tuple[int, int, torch.dtype], Tensor] = {}

    @staticmethod
    def size(n: int) -> int:
        return 2 * n * _LINE + 2 * n * ((SLOTS_BYTES // (2 * n)) // _LINE * _LINE)

    def slot(self, parity: int, rank: int, dtype: torch.dtype) -> Tensor:
        """Rank ``rank``'s slot of this parity, as a flat tensor of ``dtype``."""
        view = self._views.get((parity, rank, dtype))
        if view is None:
            view = self._views[(parity, rank, dtype)] = self.slots[parity, rank].view(dtype)
        return view

    def capacity(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` a slot holds."""
        return self.slot_bytes // dtype.itemsize

    # ---------------------------------------------------------------- one operation
    def begin(self, what: str) -> int:
        """Number and start the next operation: returns the parity of its slots."""
        if self.broken is not None:
            raise SegmentError(f"shared-memory collectives of this group failed earlier: {self.broken}")
        self.seq += 1
        self._wait(self.leave, self.seq - 2, what)
        return self.seq % 2

    def arrived(self, what: str) -> None:
        """Announce this rank's slot and wait until every rank has announced theirs."""
        self.arrive[self.me] = self.seq
        self._ring()
        self._wait(self.arrive, self.seq, what)

    def leave_op(self) -> None:
        """Say this rank no longer reads the slots of the current operation."""
        self.leave[self.me] = self.seq
        self._ring()

    def _ring(self) -> None:
        """Bump this rank's bell (after the counter it announces) and wake its waiters."""
        self.bells[self.me] += 1
        futex(self._bell_addresses[self.me], FUTEX_WAKE, WAKE_ALL, None)

    def _wait(self, row: np.ndarray, target: int, what: str) -> None:
        if min(row.tolist()) >= target:
            return
        start = time.monotonic()
        budget = 0.0 if on_lane() else poll_budget(_CPU)  # a lane thread leaves the core to its caller
        spin_until, check_at = start + budget, start + _CHECK_S
        while True:
            behind = next((q for q, v in enumerate(row.tolist()) if v < target), None)
            if behind is None:
                return
            now = time.monotonic()
            if now >= check_at:
                self._check(row, target, what, now - start)
                check_at = now + _CHECK_S
            if now < spin_until:
                os.sched_yield()
                continue
            # sleep until the rank behind rings its bell (or the next check): read the bell,
            # then its counter; a ring after the read makes the kernel return at once
            bell = int(self.bells[behind])
            if row[behind] < target:
                futex(self._bell_addresses[behind], FUTEX_WAIT, bell, timespec(check_at - now))

    def _check(self, row: np.ndarray, target: int, what: str, waited_s: float) -> None:
        behind = [q for q in range(self.n) if row[q] < target]
        for q in behind:
            if not process_alive(self.pids[q]):
                self.broken = f"group rank {q} (pid {self.pids[q]}) died during {what}"
                raise SegmentError(self.broken)
        if waited_s > self.timeout_s:
            self.broken = f"{what}: waited {waited_s:.0f} s for group ranks {behind}"
            raise SegmentError(self.broken)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: exists and is no zombie (a dead child its parent has not
    reaped yet still answers ``kill(pid, 0)``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


# -------------------------------------------------------------------- setup, per group
_SEGMENTS: weakref.WeakKeyDictionary[dist.ProcessGroup, Segment | None] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _forget() -> None:  # a forked child shares no collectives with its parent's peers
    global _LOCK
    _LOCK = threading.Lock()
    _SEGMENTS.clear()


os.register_at_fork(after_in_child=_forget)


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def group_timeout_s(pg: dist.ProcessGroup) -> float:
    try:
        timeout = pg._get_backend(_CPU).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    return (timeout if isinstance(timeout, timedelta) else dist.default_pg_timeout).total_seconds()


# where shared-memory collectives can run: x86's store order, Linux's /dev/shm
SUPPORTED = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


def _create(size: int) -> str:
    """Create a zeroed segment file of ``size`` bytes and a token after them: "path token",
    or "path " (no token) when it cannot."""
    path = SHM_DIR / f"tessera-{os.getpid()}-{secrets.token_hex(8)}"
    token = secrets.token_bytes(16)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size + len(token))
            os.pwrite(fd, token, size)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.info("cannot create %s (%s)", path, exc)
        return f"{path} "
    return f"{path} {token.hex()}"


def _setup(pg: dist.ProcessGroup) -> Segment | None:
    """Map the group's segment (collective over the group); None where it cannot be shared."""
    store = dist.distributed_c10d._get_default_store()
    n, me = dist.get_world_size(pg), dist.get_rank(pg)
    name = f"tessera/shm/{pg.group_name}"
    k = store.add(f"{name}/setups/{me}", 1)  # the k-th setup of this group on every rank
    key = f"{name}/{k}"
    store.set(f"{key}/host/{me}", f"{_host_id()} {os.getpid()}")
    peers = [store.get(f"{key}/host/{q}").decode().rsplit(" ", 1) for q in range(n)]
    if len({host for host, _ in peers}) != 1:
        logger.info("group %s spans hosts: its CPU collectives stay on gloo", pg.group_name)
        return None
    size = Segment.size(n)
    if me == 0:
        store.set(f"{key}/file", _create(size))
    path_s, token_hex = store.get(f"{key}/file").decode().rsplit(" ", 1)
    buf: mmap.mmap | None = None
    try:
        if not token_hex:
            raise OSError("group rank 0 could not create it")
        fd = os.open(path_s, os.O_RDWR)
        try:
            candidate = mmap.mmap(fd, size + 16)
        finally:
            os.close(fd)
        if candidate[size : size + 16] == bytes.fromhex(token_hex):
            buf = candidate
    except OSError as exc:
        logger.info("cannot map %s (%s): the group's CPU collectives stay on gloo", path_s, exc)
    store.set(f"{key}/ok/{me}", "1" if buf is not None else "0")
    if store.add(f"{key}/mapped", 1) == n:
        Path(path_s).unlink(missing_ok=True)  # the mappings stay; nothing is left behind
    if not all(store.get(f"{key}/ok/{q}") == b"1" for q in range(n)):
        return None
    assert buf is not None
    return Segment(buf, n, me, [int(pid) for _, pid in peers], group_timeout_s(pg))


def local_segment(group: dist.ProcessGroup | None) -> Segment | None:
    """The segment of ``group`` (set up on its first call, collectively: every rank decides
    alike), or None: off (``TESSERA_SHM``), not x86-64 Linux, not gloo, one rank, or ranks on
    more than one host."""
    if not SUPPORTED or not enabled_from_env(os.environ):
        return None
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    with _LOCK:
        if pg in _SEGMENTS:
            return _SEGMENTS[pg]
    try:
        gloo = isinstance(pg._get_backend(_CPU), dist.ProcessGroupGloo)
    except (AttributeError, RuntimeError, ValueError):
        gloo = False
    segment = _setup(pg) if gloo and dist.get_world_size(pg) > 1 else None
    with _LOCK:
        _SEGMENTS[pg] = segment
    return segment


def applies(x: Tensor, group: dist.ProcessGroup | None) -> Segment | None:
    """The segment that serves a collective of ``x`` on ``group`` (`local_segment`), or None:
    only non-empty CPU tensors. The functions below take detached tensors (they record no
    autograd graph)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return None
    return local_segment(group)


# -------------------------------------------------------------------- the collectives
def _combine_into(dst: Tensor, parts: Sequence[Tensor], op: str) -> None:
    fn = _COMBINE[op]
    fn(parts[0], parts[1], out=dst)
    for part in parts[2:]:
        fn(dst, part, out=dst)


def all_reduce(seg: Segment, buffer: Tensor, op: Literal["sum", "avg", "max", "min"]) -> None:
    """Reduce ``buffer`` (contiguous) in place over the segment's ranks."""
    flat, per = buffer.view(-1), seg.capacity(buffer.dtype)
    for start in range(0, flat.numel(), per):
        piece = flat[start : start + per]
        k = piece.numel()
        parity = seg.begin("all_reduce")
        seg.slot(parity, seg.me, buffer.dtype)[:k].copy_(piece)
        seg.arrived("all_reduce")
        _combine_into(piece, [seg.slot(parity, q, buffer.dtype)[:k] for q in range(seg.n)], op)
        seg.leave_op()
    if op == "avg":
        buffer.div_(seg.n)


def all_gather(seg: Segment, src: Tensor, flat: Tensor) -> None:
    """Gather every rank's ``src`` into ``flat`` (contiguous, ``n`` times ``src``) in rank order."""
    mine, per = src.reshape(-1), seg.capacity(src.dtype)
    parts = flat.view(seg.n, -1)
    for start in range(0, mine.numel(), per):
        k = min(per, mine.numel() - start)
        parity = seg.begin("all_gather")
        seg.slot(parity, seg.me, src.dtype)[:k].copy_(mine[start : start + k])
        seg.arrived("all_gather")
        for q in range(seg.n):
            parts[q, start : start + k].copy_(seg.slot(parity, q, src.dtype)[:k])
        seg.leave_op()


def reduce_scatter(
    seg: Segment, chunks: Sequence[Tensor], out: Tensor, op: Literal["sum", "avg", "max", "min"]
) -> None:
    """Reduce chunk ``rank`` of every rank's ``chunks`` into ``out`` (contiguous, chunk-sized)."""
    n, me = seg.n, seg.me
    flats = [c.reshape(-1) for c in chunks]
    total, per = flats[0].numel(), seg.capacity(out.dtype) // n
    dst = out.view(-1)
    for start in range(0, total, per):
        k = min(per, total - start)
        parity = seg.begin("reduce_scatter")
        slot = seg.slot(parity, me, out.dtype)
        for j in range(n):
            slot[j * k : (j + 1) * k].copy_(flats[j][start : start + k])
        seg.arrived("reduce_scatter")
        parts = [seg.slot(parity, q, out.dtype)[me * k : (me + 1) * k] for q in range(n)]
        _combine_into(dst[start : start + k], parts, op)
        seg.leave_op()
    if op == "avg":
        out.div_(n)


def broadcast(seg: Segment, buffer: Tensor, src: int) -> None:
    """Overwrite ``buffer`` (contiguous) with group rank ``src``'s."""
    flat, per = buffer.view(-1), seg.capacity(buffer.dtype)
    for start in range(0, flat.numel(), per):
        piece = flat[start : start + per]
        k = piece.numel()
        parity = seg.begin("broadcast")
        if seg.me == src:
            seg.slot(parity, src, buffer.dtype)[:k].copy_(piece)
        seg.arrived("broadcast")
        if seg.me != src:
            piece.copy_(seg.slot(parity, src, buffer.dtype)[:k])
        seg.leave_op()


def all_to_all(seg: Segment, src: Tensor, out: Tensor) -> None:
    """Send ``src[j]`` (``src``: contiguous, one row per rank) to rank j; ``out[j]`` (same
    shape) receives rank j's row for this rank."""
    n, me = seg.n, seg.me
    rows, dst = src.view(n, -1), out.view(n, -1)
    total, per = rows.shape[1], seg.capacity(src.dtype) // n
    for start in range(0, total, per):
        k = min(per, total - start)
        parity = seg.begin("all_to_all")
        seg.slot(parity, me, src.dtype)[: n * k].view(n, k).copy_(rows[:, start : start + k])
        seg.arrived("all_to_all")
        for q in range(n):
            dst[q, start : start + k].copy_(seg.slot(parity, q, src.dtype)[me * k : (me + 1) * k])
        seg.leave_op()
