"""Cross-entropy over vocabulary-sharded logits, without gathering the logits.

Each rank holds logits ``(..., V/tp)`` for vocabulary rows ``[r V/tp, (r+1) V/tp)`` (the
output of a column-parallel LM head). Forward: an all-reduce (max) of the per-token maxima
and one all-reduce (sum) of the per-token sums of exponentials and target logits, i.e.
3 fp32 numbers per token (moved 2x each); no rank ever holds a full row of logits. Backward
is local: ``softmax - one_hot(target)`` on this rank's columns, times the incoming gradient.
Computed in fp32 whatever the logits' dtype; the gradient comes back in the logits' dtype.
On a group of one rank it is ``F.cross_entropy`` on the fp32 logits (one fused kernel, no
collectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.comm import Group, all_reduce, group_rank, group_size, reduce_from_region
from tessera.comm.ops import apply_function

__all__ = ["blocked_cross_entropy", "vocab_parallel_cross_entropy"]

Reduction = Literal["mean", "sum", "none"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, group: Group, ignore_index: int) -> Tensor:
        x = logits.float()
        local_vocab = x.shape[-1]
        start = group_rank(group) * local_vocab
        gmax = all_reduce(x.detach().amax(dim=-1), group, op="max", inplace=True)
        shifted = x - gmax.unsqueeze(-1)
        valid = targets != ignore_index
        local_t = targets - start
        mine = valid & (local_t >= 0) & (local_t < local_vocab)
        safe = torch.where(mine, local_t, torch.zeros_like(local_t))
        picked = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp_()
        sums = all_reduce(torch.stack([exp.sum(dim=-1), picked]), group, inplace=True)
        sum_exp, target_logit = sums[0], sums[1]
        loss = (sum_exp.log() - target_logit) * valid
        exp.div_(sum_exp.unsqueeze(-1))  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(exp, safe, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, safe, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, safe.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        g.mul_((grad.float() * valid).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    group: Group = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> Tensor:
    """``F.cross_entropy(gathered_logits, targets)`` computed from this rank's vocabulary shard.

    ``logits``: (..., V/tp), this rank's columns; ``targets``: (...), global token ids.
    Targets equal to ``ignore_index`` add nothing; ``mean`` divides by the number of the
    others (NaN when there are none, as in torch). The loss is replicated on every rank,
    in the logits' dtype (``sum``: in fp32, as a sum over many tokens can leave a half
    precision's range). Moves two all-reduces of per-token fp32 scalars (see the module).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
            f"{tuple(targets.shape)} disagree on the leading dims"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if group_size(group) == 1:  # the whole vocabulary here: torch's fused kernel, in fp32
        x, t = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        out = F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)
        if reduction == "sum":
            return out
        return (out.view(targets.shape) if reduction == "none" else out).to(logits.dtype)
    per_token = apply_function(_VocabParallelCrossEntropy, logits, targets, group, ignore_index)
    if reduction == "none":
        return per_token.to(logits.dtype)
    total = per_token.sum()
    if reduction == "sum":
        return total.float()
    count = (targets != ignore_index).sum()
    return (total / count).to(logits.dtype)


def blocked_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    vocab: Group,
    blocks: Sequence[Group],
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """The mean (or ``sum``) of ``F.cross_entropy`` over a batch whose blocks lie on the ranks of
    ``blocks`` (the groups whose sums, one after the other, reach every block) and whose
    vocabulary is split over ``vocab``: the 2D, 2.5D and 3D classifiers' loss.

    ``vocab_parallel_cross_entropy``'s sum over this rank's tokens, then that sum (and, for the
    mean, the count of counted tokens) all-reduced over each group of ``blocks``; the backward
    of the sums is the identity. Replicated on every rank, in the logits' dtype (``sum``: in
    fp32, as a sum over many tokens can leave a half precision's range).
    """
    total = vocab_parallel_cross_entropy(
        logits, targets, vocab, ignore_index=ignore_index, reduction="sum"
    ).reshape(1)  # fp32, summed before any rounding to the logits' dtype
    count = (targets != ignore_index).sum().float().reshape(1)
    for group in blocks:
        total = reduce_from_region(total, group)
        if reduction == "mean":
            count = all_reduce(count, group)
    if reduction == "sum":
        return total.squeeze(0)
    return (total / count).squeeze(0).to(logits.dtype)
