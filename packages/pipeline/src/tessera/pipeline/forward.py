"""Forward only: the whole batch through the pipeline, stage after stage, for evaluation.

No schedule is needed: without a backward there is nothing to interleave, so each rank runs
its stages in order, receiving the activations of the stage before from its owner and
sending its output on. Every activation is announced by a shape header, so nothing about
the model's sizes has to be known in advance. The last stage's loss is broadcast to every
rank of the group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from tessera.comm import Group, broadcast, group_rank, recv, send
from tessera.pipeline.channels import HEADER_SIZE, decode_header, encode_header

__all__ = ["forward_loss"]


def _send(x: Tensor, dst: int, group: Group) -> None:
    send(encode_header(x), dst, group)
    send(x.contiguous(), dst, group)


def _recv(src: int, group: Group, device: torch.device) -> Tensor:
    header = recv(torch.empty(HEADER_SIZE, dtype=torch.int64, device=device), src, group)
    shape, dtype = decode_header(header)
    return recv(torch.empty(shape, dtype=dtype, device=device), src, group)


@torch.no_grad()
def forward_loss(
    stages: Mapping[int, nn.Module],
    stage_to_rank: Sequence[int],
    inputs: Tensor | None,
    targets: Tensor | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    group: Group,
    device: torch.device,
) -> float:
    """The loss of ``inputs`` against ``targets`` through every stage (collective over ``group``).

    ``stages`` holds this rank's stages; ``inputs`` is needed on the first stage's rank and
    ``targets`` on the last's. Moves each boundary activation once (plus a 10-int header)
    and broadcasts one float64.
    """
    me = group_rank(group)
    act = inputs
    loss = torch.zeros(1, dtype=torch.float64, device=device)
    last = len(stage_to_rank) - 1
    for s, owner in enumerate(stage_to_rank):
        if owner != me:
            continue
        if s > 0 and stage_to_rank[s - 1] != me:
            act = _recv(stage_to_rank[s - 1], group, device)
        if act is None:
            raise ValueError(f"rank {me} holds the first stage and needs the inputs; got None")
        act = stages[s](act)
        if s < last and stage_to_rank[s + 1] != me:
            _send(act, stage_to_rank[s + 1], group)
        elif s == last:
            if targets is None:
                raise ValueError(f"rank {me} holds the last stage and needs the targets; got None")
            loss[0] = float(loss_fn(act, targets))
    return float(broadcast(loss, stage_to_rank[last], group)[0])
