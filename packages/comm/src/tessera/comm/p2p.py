"""Point-to-point transfers: batched isend/irecv and the ring shift, with async handles.

Peers are named by their rank *inside* ``group`` (``None``: the world). Torch's threaded
test backend has no send/recv; use the gloo worker pool (tessera.comm.testing) to test p2p.

CPU tensors on a gloo group travel through shared-memory FIFOs once every rank of the group
has called `share_memory(group)` and its ranks share a host (`tessera.comm.shm_p2p`; a
collective on the group does not switch its messages over, so ranks that reach it at
different points never disagree on the transport), else over `tessera.comm.links` (private
two-rank gloo groups, 1.7-2.4x faster than torch's gloo p2p). Their handles report
completion as it happens, so ``wait()`` polls first (`tessera.comm.waiting`). Elsewhere
torch's ``batch_isend_irecv`` runs. All match messages in post order per (pair, tag).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import links, shm_p2p
from tessera.comm.collectives import Group, Handle, Waitable, group_rank, group_size
from tessera.comm.eager import never_compiled
from tessera.comm.meters import CommOp, record
from tessera.comm.profiling import P2P_WAIT, profiled
from tessera.comm.shm_p2p import share_memory
from tessera.comm.waiting import poll_budget

__all__ = ["batch_isend_irecv", "has_p2p", "recv", "ring_shift", "ring_shift_async", "send", "share_memory"]

_CPU = torch.device("cpu")


def has_p2p(group: Group = None) -> bool:
    """Whether ``group``'s backend sends and receives (torch's threaded test backend does not)."""
    return str(dist.get_backend(group)) != "threaded"


def _global(peer: int, group: Group) -> int:
    n = group_size(group)
    if not 0 <= peer < n:
        raise ValueError(f"peer {peer} is outside the group of {n} ranks")
    if peer == group_rank(group):
        raise ValueError(f"peer {peer} is this rank itself; p2p needs another rank")
    return peer if group is None else dist.get_global_rank(group, peer)


@never_compiled
@profiled("tessera.comm.batch_isend_irecv")
def batch_isend_irecv(
    sends: Sequence[tuple[Tensor, int]],
    recvs: Sequence[tuple[Tensor, int]],
    group: Group = None,
    *,
    tag: int = 0,
) -> Handle[list[Tensor]]:
    """Post every send ``(tensor, peer)`` and receive ``(buffer, peer)`` at once.

    Receives land in the given buffers; ``wait()`` returns them in order. Sends read their
    tensor until the handle completes, so do not modify it before ``wait()``. A send matches
    only a receive of the same ``tag`` (gloo honours tags; NCCL ignores them). The tag
    ``tessera.comm.gloo_ring.RING_TAG`` is reserved for the gloo ring collectives.
    """
    outgoing = [(tensor.detach().contiguous(), peer) for tensor, peer in sends]
    incoming = list(recvs)
    for tensor, peer in outgoing:
        _global(peer, group)  # checks the peer
        record(CommOp.SEND, group_size=2, nbytes=tensor.nbytes, like=tensor)
    for buffer, peer in incoming:
        if not buffer.is_contiguous():
            raise ValueError(f"receive buffer from peer {peer} must be contiguous")
        _global(peer, group)
        record(CommOp.RECV, group_size=2, nbytes=buffer.nbytes, like=buffer)
    buffers = [buffer for buffer, _ in incoming]
    tensors = [t for t, _ in outgoing] + buffers
    if shm_p2p.applies(tensors, group):
        shared: list[Waitable] = [shm_p2p.isend(t, peer, group, tag) for t, peer in outgoing]
        shared += [shm_p2p.irecv(b, peer, group, tag) for b, peer in incoming]
        return Handle(shared, lambda: buffers, wait_name=P2P_WAIT)
    if links.applies(tensors, group):
        works: list[Waitable] = [links.isend(t, peer, group, tag) for t, peer in outgoing]
        works += [links.irecv(b, peer, group, tag) for b, peer in incoming]
        return Handle(works, lambda: buffers, wait_name=P2P_WAIT, poll_s=poll_budget(_CPU))
    ops = [dist.P2POp(dist.isend, t, _global(peer, group), group, tag) for t, peer in outgoing]
    ops += [dist.P2POp(dist.irecv, b, _global(peer, group), group, tag) for b, peer in incoming]
    return Handle(list(dist.batch_isend_irecv(ops) if ops else []), lambda: buffers, wait_name=P2P_WAIT)


def send(x: Tensor, peer: int, group: Group = None) -> None:
    """Send ``x`` to ``peer`` and wait until it has left."""
    batch_isend_irecv([(x, peer)], [], group).wait()


def recv(like: Tensor, peer: int, group: Group = None) -> Tensor:
    """Receive a tensor shaped and typed like ``like`` from ``peer``."""
    buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
    return batch_isend_irecv([], [(buffer, peer)], group).wait()[0]


def ring_shift_async(x: Tensor, group: Group = None, shift: int = 1) -> Handle[Tensor]:
    """Start sending ``x`` to rank ``r + shift`` while receiving rank ``r - shift``'s (mod n).

    Every rank's ``x`` must have the same shape and dtype. A shift that is a multiple of the
    group size returns a copy of ``x`` without communicating.
    """
    n = group_size(group)
    if shift % n == 0:
        copy = x.detach().clone(memory_format=torch.contiguous_format)
        return Handle([], lambda: copy)
    me = group_rank(group)
    buffer = torch.empty_like(x, memory_format=torch.contiguous_format)
    handle = batch_isend_irecv([(x, (me + shift) % n)], [(buffer, (me - shift) % n)], group)
    return Handle([handle], lambda: buffer)


def ring_shift(x: Tensor, group: Group = None, shift: int = 1) -> Tensor:
    """Send ``x`` to rank ``r + shift`` and return what rank ``r - shift`` sent (mod n)."""
    return ring_shift_async(x, group, shift).wait()
