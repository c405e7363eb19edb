"""Expert-parallel token exchange: dispatch rows to the ranks that own their experts, and
combine the experts' outputs back, both differentiable.

``E`` experts over ``P`` ranks of the ep group: rank ``p`` owns the ``L = E / P`` experts
``p*L .. p*L + L - 1``. A rank's kept assignments arrive sorted by expert, so they are
already grouped by owner. `plan_exchange` first exchanges the per-expert counts (an
all-to-all of ``E`` integers), so every rank knows how many rows it sends to and receives
from each rank and for which of its experts; `dispatch` moves the rows (uneven all-to-all)
and reorders them from source-major (rank, then expert) to expert-major (expert, then
rank, each source's rows in its token order); `combine` undoes both. The backward of each
move is the opposite move (`tessera.comm.all_to_all_rows` with the counts swapped).

Every rank of the group must run the forward and the backward together: each move is a
collective. So that a rank whose inputs need no gradient still takes part in the backward
(other ranks' gradients pass through it), a move under grad mode always records itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import all_to_all, all_to_all_rows, group_size
from tessera.comm.ops import apply_function

__all__ = ["Exchange", "combine", "dispatch", "exchange_rows", "plan_exchange"]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return all_to_all_rows(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def exchange_rows(x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable `all_to_all_rows`: forward sends ``send[j]`` rows to rank j and receives
    ``recv[j]`` from it; backward sends the gradients of the received rows back."""
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()  # take part in the backward (module docstring)
    return apply_function(_AllToAllRows, x, send, recv, group)


@dataclass(frozen=True, slots=True)
class Exchange:
    """What one rank sends and receives in one layer call.

    ``send[j]`` / ``recv[j]``: rows to / from group rank j; ``order``: received rows
    (source-major) taken in this order are expert-major; ``inverse``: its inverse;
    ``local_counts [L]``: rows for each of this rank's experts, from all ranks.
    """

    send: list[int]
    recv: list[int]
    order: Tensor
    inverse: Tensor
    local_counts: Tensor


def plan_exchange(kept: Tensor, group: dist.ProcessGroup) -> Exchange:
    """From this rank's kept rows per (global) expert, ``kept [E]``, exchange counts with the
    group (an all-to-all of ``E`` integers: each rank learns, per source rank, how many rows
    each of its own experts receives) and derive the row movement."""
    ranks = group_size(group)
    local = kept.numel() // ranks
    incoming = all_to_all(kept.contiguous(), group).view(ranks, local)  # [source, local expert]
    blocks = torch.arange(ranks * local, device=kept.device)
    block_of_row = torch.repeat_interleave(blocks, incoming.reshape(-1))
    key = (block_of_row % local) * ranks + block_of_row // local  # expert-major block index
    order = torch.sort(key, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return Exchange(
        send=kept.view(ranks, local).sum(1).tolist(),
        recv=incoming.sum(1).tolist(),
        order=order,
        inverse=inverse,
        local_counts=incoming.sum(0),
    )


def dispatch(rows: Tensor, ex: Exchange, group: dist.ProcessGroup) -> Tensor:
    """Send ``rows`` (sorted by expert) to their experts' owners; return the rows this rank's
    experts process, expert-major."""
    return exchange_rows(rows, ex.send, ex.recv, group).index_select(0, ex.order)


def combine(out: Tensor, ex: Exchange, group: dist.ProcessGroup) -> Tensor:
    """Return the experts' outputs ``out`` (expert-major, as `dispatch` gave) to the ranks the
    rows came from, each in the order it sent them."""
    return exchange_rows(out.index_select(0, ex.inverse), ex.recv, ex.send, group)
