"""Point-to-point between ranks of one host through shared memory: one FIFO per direction.

Once every rank of a group has called `share_memory` on it (a collective: it sets up the
group's shared-memory segment, `tessera.comm.shm`, and says whether its ranks share a host),
its messages go through a file both ranks of a pair map, not over sockets. Only that
explicit call switches a group's messages over: a collective on the group sets up the same
segment, but ranks reach their first collective at different points of their programs, and a
rank that sent before it while its peer received after would choose another transport than
its peer and wait forever. Each pair of group ranks, per tag, has one file with a FIFO per
direction: ``SLOTS`` slots of ``SLOT_BYTES`` bytes, a ``sent`` counter the producer advances
and a ``done`` counter the consumer advances, each with a bell (a futex word the writer
bumps and wakes, as in `tessera.comm.shm`). A message goes in slot-sized pieces; each piece
carries the bytes of the message left, so a receive whose buffer differs from the message
sent fails naming both sizes instead of reading garbage. Posting never blocks: a send copies
what fits now, a receive takes what has arrived, and every ``is_completed()`` and ``wait()``
of this process moves its own pending transfers on (so a send larger than the FIFO completes
while its rank waits for anything). Messages of one (pair, tag) arrive in post order, as
with torch's p2p.

Both ranks create the pair's file (same name: a job token from the store, the group, the tag
and the pair) the first time they use it, without waiting for each other, and the second of
them to map it unlinks it. A file whose peer never mapped it (a program that sends to a rank
that never receives) is unlinked when its process exits.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing.util
import os
import secrets
import threading
import time
import weakref
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import shm
from tessera.comm.gloo_ring import on_lane
from tessera.comm.shm_env import enabled_from_env
from tessera.comm.shm_sizes import LINE_BYTES
from tessera.comm.waiting import poll_budget

__all__ = ["SLOTS", "SLOT_BYTES", "Transfer", "applies", "irecv", "isend", "share_memory"]

SLOTS = 4
SLOT_BYTES = 256 << 10
"""Each direction of a pair holds SLOTS pieces of SLOT_BYTES: 1 MiB, 2 MiB a pair."""
_LINE = LINE_BYTES
_HEADER = 8 * _LINE  # pids (2 lines), per direction: sent, done (2 x 2 lines), piece lengths (2 lines)
_CHECK_S = 0.05
_CPU = torch.device("cpu")
_ACTIVE: set[_Direction] = set()  # directions of this process with a transfer that could not finish


class _Direction:
    """One FIFO of a pair as this process sees it: as its producer or its consumer."""

    def __init__(self, buf: mmap.mmap, d: int, producer: bool, peer_pid_line: np.ndarray) -> None:
        words = np.frombuffer(buf, dtype=np.int64, count=_HEADER // 8).reshape(_HEADER // _LINE, _LINE // 8)
        base = words.ctypes.data
        self.sent, self.done = words[2 + 2 * d], words[3 + 2 * d]  # [0]: counter, bytes 8-11: bell
        self.left = words[6 + d]  # per slot: bytes of the message left from that piece on
        bells = words.view(np.int32).reshape(_HEADER // _LINE, _LINE // 4)
        self.sent_bell, self.done_bell = bells[2 + 2 * d], bells[3 + 2 * d]
        self.sent_bell_at = base + (2 + 2 * d) * _LINE + 8
        self.done_bell_at = base + (3 + 2 * d) * _LINE + 8
        offset = _HEADER + d * SLOTS * SLOT_BYTES
        self.slots = torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=SLOTS * SLOT_BYTES).view(
            SLOTS, SLOT_BYTES
        )
        self.producer = producer
        self.peer_pid = peer_pid_line
        self.queue: deque[Transfer] = deque()
        self.lock = threading.Lock()
        self.error: str | None = None

    def progress(self) -> None:
        """Move this process's pending transfers of the direction on, in post order."""
        with self.lock:
            while self.queue:
                head = self.queue[0]
                if not (self._push(head) if self.producer else self._pull(head)):
                    _ACTIVE.add(self)
                    return
                head.finished = True
                self.queue.popleft()
            _ACTIVE.discard(self)

    def _push(self, t: Transfer) -> bool:
        while t.pos < t.nbytes:
            sent = int(self.sent[0])
            if sent - int(self.done[0]) >= SLOTS:
                return False
            k, n = sent % SLOTS, min(SLOT_BYTES, t.nbytes - t.pos)
            self.slots[k, :n].copy_(t.data[t.pos : t.pos + n])
            self.left[k] = t.nbytes - t.pos
            t.pos += n
            self.sent[0] = sent + 1  # after the piece and its length (x86 keeps stores in order)
            self.sent_bell[2] += 1
            shm.futex(self.sent_bell_at, shm.FUTEX_WAKE, shm.WAKE_ALL, None)
        return True

    def _pull(self, t: Transfer) -> bool:
        while t.pos < t.nbytes:
            done = int(self.done[0])
            if done >= int(self.sent[0]):
                return False
            k, n = done % SLOTS, min(SLOT_BYTES, t.nbytes - t.pos)
            left = int(self.left[k])
            if left != t.nbytes - t.pos:
                sent_bytes = left + t.pos
                self.error = (
                    f"a message of {sent_bytes} bytes arrived for a receive buffer of {t.nbytes} bytes"
                )
                raise RuntimeError(f"shared-memory p2p: {self.error}")
            t.data[t.pos : t.pos + n].copy_(self.slots[k, :n])
            t.pos += n
            self.done[0] = done + 1
            self.done_bell[2] += 1
            shm.futex(self.done_bell_at, shm.FUTEX_WAKE, shm.WAKE_ALL, None)
        return True


class Transfer:
    """A send or receive on a FIFO; ``is_completed()`` and ``wait()`` move it on."""

    __slots__ = ("data", "direction", "finished", "nbytes", "pos", "timeout_s")

    def __init__(self, direction: _Direction, tensor: Tensor, timeout_s: float) -> None:
        self.direction = direction
        self.data = tensor.view(-1).view(torch.uint8)
        self.nbytes = self.data.numel()
        self.pos = 0
        self.finished = False
        self.timeout_s = timeout_s

    def is_completed(self) -> bool:
        """Whether it has finished, after moving every pending transfer of this process on
        (a rank that polls one receive must still feed the sends its peers wait for)."""
        if not self.finished:
            for other in list(_ACTIVE):
                if other is not self.direction:
                    other.progress()
            self.direction.progress()
        return self.finished

    def wait(self) -> bool:
        if self.is_completed():
            return True
        d = self.direction
        start = time.monotonic()
        budget = 0.0 if on_lane() else poll_budget(_CPU)
        spin_until, check_at = start + budget, start + _CHECK_S
        bell, bell_at = (d.done_bell, d.done_bell_at) if d.producer else (d.sent_bell, d.sent_bell_at)
        while True:
            now = time.monotonic()
            if now >= check_at:
                self._check(now - start)
                check_at = now + _CHECK_S
            if now < spin_until:
                os.sched_yield()
            else:  # the peer rings this bell when it moves the FIFO on (see tessera.comm.shm)
                rung = int(bell[2])
                if self.is_completed():
                    return True
                others = len(_ACTIVE) > (d in _ACTIVE)
                nap = min(check_at - now, 0.001) if others else check_at - now
                shm.futex(bell_at, shm.FUTEX_WAIT, rung, shm.timespec(nap))
            if self.is_completed():
                return True

    def _check(self, waited_s: float) -> None:
        pid = int(self.direction.peer_pid[0])
        what = "send" if self.direction.producer else "receive"
        if pid and not shm.process_alive(pid):
            raise RuntimeError(f"shared-memory p2p: the peer (pid {pid}) died during a {what}")
        if waited_s > self.timeout_s:
            raise RuntimeError(f"shared-memory p2p: a {what} waited {waited_s:.0f} s")


class _Pair:
    """The file of one pair (group ranks lo < hi) for one tag, mapped by this process."""

    def __init__(self, path: str, me_lo: bool) -> None:
        size = _HEADER + 2 * SLOTS * SLOT_BYTES
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        pids = np.frombuffer(self.buf, dtype=np.int64, count=2 * _LINE // 8).reshape(2, _LINE // 8)
        mine, theirs = (pids[0], pids[1]) if me_lo else (pids[1], pids[0])
        mine[0] = os.getpid()
        # direction 0 runs lo -> hi: lo produces it
        self.out = _Direction(self.buf, 0 if me_lo else 1, True, theirs)
        self.into = _Direction(self.buf, 1 if me_lo else 0, False, theirs)


_PAIRS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, int, int], _Pair]]
_PAIRS = weakref.WeakKeyDictionary()
_BUILT: dict[tuple[str, int, int, int], int] = {}
_FIRST: set[str] = set()  # pair files this process mapped first: the peer unlinks them when it maps
_SHARED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()  # groups `share_memory` said share a host
_LOCK = threading.Lock()


def _forget() -> None:  # a forked child has none of its parent's pairs
    global _LOCK
    _LOCK = threading.Lock()
    _PAIRS.clear()
    _SHARED.clear()
    _BUILT.clear()
    _FIRST.clear()


def _unlink_unmapped() -> None:
    """At exit: the files of pairs whose peer never mapped them (else already gone)."""
    for path in _FIRST:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


os.register_at_fork(after_in_child=_forget)


def _pair(pg: dist.ProcessGroup, peer: int, tag: int) -> _Pair:
    me = dist.get_rank(pg)
    lo, hi = min(me, peer), max(me, peer)
    with _LOCK:
        pairs = _PAIRS.setdefault(pg, {})
        pair = pairs.get((tag, lo, hi))
        if pair is not None:
            return pair
        name = (pg.group_name, tag, lo, hi)
        k = _BUILT[name] = _BUILT.get(name, 0) + 1  # a group rebuilt under its name: a new file
        store = dist.distributed_c10d._get_default_store()
        job = store.compare_set("tessera/shm/job", "", secrets.token_hex(8)).decode()
        path = str(shm.SHM_DIR / f"tessera-{job}-p2p-{pg.group_name}-{tag}-{lo}-{hi}-{k}")
        pair = pairs[(tag, lo, hi)] = _Pair(path, me == lo)
        if store.add(f"{path}/mapped", 1) == 2:
            os.unlink(path)  # both ranks map it; nothing is left behind
        else:
            if not _FIRST:  # at exit, also of a multiprocessing worker (which skips atexit)
                multiprocessing.util.Finalize(None, _unlink_unmapped, exitpriority=0)
            _FIRST.add(path)
        return pair


def share_memory(group: dist.ProcessGroup | None) -> bool:
    """Collective over ``group``: set up (once) what lets its ranks exchange through shared
    memory, and say whether they can (all on one host, see `tessera.comm.shm.applies`). From
    then on this rank's messages on ``group`` go through shared memory when they can; every
    rank of the group calls it before its first message on the group, or none does."""
    if shm.local_segment(group) is None:
        return False
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    with _LOCK:
        _SHARED.add(pg)
    return True


def applies(tensors: list[Tensor], group: dist.ProcessGroup | None) -> bool:
    """Whether p2p of ``tensors`` on ``group`` goes through shared memory: CPU tensors on a
    group `share_memory` found on one host (never sets anything up: p2p is not collective)."""
    if not tensors or any(t.device.type != "cpu" for t in tensors) or not enabled_from_env(os.environ):
        return False
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return False
    with _LOCK:
        return pg in _SHARED


def _post(tensor: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int, send: bool) -> Transfer:
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    pair = _pair(pg, peer, tag)
    direction = pair.out if send else pair.into
    transfer = Transfer(direction, tensor, shm.group_timeout_s(pg))
    with direction.lock:
        direction.queue.append(transfer)
    direction.progress()
    return transfer


def isend(tensor: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int = 0) -> Transfer:
    """Post ``tensor`` (contiguous; not modified until the transfer completes) to ``peer``."""
    return _post(tensor, peer, group, tag, send=True)


def irecv(buffer: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int = 0) -> Transfer:
    """Post a receive of ``peer``'s next message on this tag into ``buffer`` (contiguous)."""
    return _post(buffer, peer, group, tag, send=False)
