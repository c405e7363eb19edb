"""The 2D classifier's loss, and the split of a global batch into a rank's 2D block.

The classifier is a ``Linear2D`` (style ``2d_classifier``): its logits (..., vocab/q) hold
vocabulary block j of batch block i. ``cross_entropy_2d`` computes the exact global mean
cross-entropy without any rank holding a full row of logits: the vocab-parallel
cross-entropy over the row group (``tp_row``; 3 fp32 numbers per token all-reduced, as in
1D), then the sum over the batch rows by an all-reduce over the column group (``tp_col``;
one number, plus the count of counted tokens). Every rank gets the same loss; backward is
local (the softmax minus the one-hot on this rank's vocabulary columns, times 1/N).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from tessera.tensor_parallel.loss import blocked_cross_entropy
from tessera.tensor_parallel.two_d.grid import Grid2D, check_grid_divisible

__all__ = ["batch_block", "cross_entropy_2d", "loss_2d"]


def batch_block(x: Tensor, grid: Grid2D, *, dim: int = 0) -> Tensor:
    """This rank's batch block (block i of q along ``dim``) of a global batch every rank holds.

    Plain slicing (data, no gradient to route back). ValueError naming the numbers unless q
    divides the batch.
    """
    check_grid_divisible(
        int(x.shape[dim]), grid.q, what=f"batch (dim {dim} of {tuple(x.shape)})", where="batch_block"
    )
    return x.chunk(grid.q, dim)[grid.i]


def cross_entropy_2d(
    logits: Tensor,
    targets: Tensor,
    grid: Grid2D,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """The mean (or ``sum``) over the global batch of ``F.cross_entropy`` of the gathered logits.

    ``logits`` (..., vocab/q): batch block i, vocabulary block j; ``targets`` (...): batch
    block i, global token ids. Moves 2 all-reduces of per-token fp32 numbers over the row
    and one of 2 numbers over the column (1 for ``sum``); the loss is replicated on every rank.
    """
    return blocked_cross_entropy(
        logits, targets, grid.row, [grid.col], ignore_index=ignore_index, reduction=reduction
    )


def loss_2d(
    model: nn.Module, idx: Tensor, targets: Tensor, grid: Grid2D, *, ignore_index: int = -100
) -> Tensor:
    """The global mean next-token loss of a 2D-parallelized language model (e.g. the reference
    GPT under ``GPT_2D_PLAN``) on the global batch ``idx``, ``targets`` (batch first, the same
    on every rank): each rank runs its batch block; logits stay vocabulary-split."""
    logits = model(batch_block(idx, grid))
    return cross_entropy_2d(logits, batch_block(targets, grid), grid, ignore_index=ignore_index)
