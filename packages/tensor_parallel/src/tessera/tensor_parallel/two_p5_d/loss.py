"""The 2.5D classifier's loss, and the split of a global batch into a rank's 2.5D block.

The classifier is a ``Linear2p5D`` (style ``2.5d_classifier``): its logits (..., vocab/q) hold
vocabulary block j of batch block ``k*q + i``. ``cross_entropy_2p5d`` is the exact global
mean cross-entropy with no rank holding a full row of logits: the vocab-parallel
cross-entropy over the row (``tp_row``: 3 fp32 numbers per token all-reduced, as in 1D and
2D), then the sum of the per-token losses and the count of counted tokens over the column
(``tp_col``) and over the depth (``tp_dep``): 2 numbers each. Every rank gets the same loss;
backward is local (softmax minus one-hot on this rank's vocabulary columns, times 1/N).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from tessera.tensor_parallel.loss import blocked_cross_entropy
from tessera.tensor_parallel.two_p5_d.grid import Grid2p5D, check_batch_2p5d

__all__ = ["batch_block_2p5d", "cross_entropy_2p5d", "loss_2p5d"]


def batch_block_2p5d(x: Tensor, grid: Grid2p5D, *, dim: int = 0) -> Tensor:
    """This rank's batch block (block ``k*q + i`` of q*d along ``dim``) of a global batch every
    rank holds. Plain slicing; ValueError naming the numbers unless q*d divides the batch."""
    check_batch_2p5d(int(x.shape[dim]), grid.q, grid.d, where=f"batch_block_2p5d of {tuple(x.shape)}")
    return x.chunk(grid.q * grid.d, dim)[grid.batch_index]


def cross_entropy_2p5d(
    logits: Tensor,
    targets: Tensor,
    grid: Grid2p5D,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """The mean (or ``sum``) over the global batch of ``F.cross_entropy`` of the gathered logits.

    ``logits`` (..., vocab/q): batch block ``k*q + i``, vocabulary block j; ``targets`` (...):
    the same batch block, global token ids. Moves 2 all-reduces of per-token fp32 numbers
    over the row, and one number each (the loss sum, the count) over the column and the depth.
    """
    return blocked_cross_entropy(
        logits, targets, grid.row, [grid.col, grid.dep], ignore_index=ignore_index, reduction=reduction
    )


def loss_2p5d(
    model: nn.Module, idx: Tensor, targets: Tensor, grid: Grid2p5D, *, ignore_index: int = -100
) -> Tensor:
    """The global mean next-token loss of a 2.5D-parallelized language model (e.g. the reference
    GPT under ``GPT_2P5D_PLAN``) on the global batch ``idx``, ``targets`` (batch first, the same
    on every rank): each rank runs its batch block; the logits stay vocabulary-split."""
    logits = model(batch_block_2p5d(idx, grid))
    return cross_entropy_2p5d(logits, batch_block_2p5d(targets, grid), grid, ignore_index=ignore_index)
