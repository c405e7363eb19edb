"""The 3D classifier's loss, and the split of a global batch into a rank's 3D block.

The classifier is a ``Linear3D`` (style ``3d_classifier``) from the stream layout: its
logits (batch/q^2, ..., vocab/q) are in the branch layout, vocabulary block a of batch block
``b*q + c``. ``cross_entropy_3d`` computes the exact global mean cross-entropy without any
rank holding a full row of logits: the vocab-parallel cross-entropy over the ``tp_input``
line (3 fp32 numbers per token all-reduced, as in 1D), then the sum over the q*q batch
blocks by all-reduces of one number (and the count of counted tokens) along the
``tp_weight`` and ``tp_output`` lines. Every rank gets the same loss; backward is local.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from tessera.tensor_parallel.loss import blocked_cross_entropy
from tessera.tensor_parallel.three_d.cube import Cube3D, check_cube_divisible

__all__ = ["batch_block", "cross_entropy_3d", "loss_3d"]


def batch_block(x: Tensor, cube: Cube3D, *, branch: bool = False, dim: int = 0) -> Tensor:
    """This rank's batch block of a global batch every rank holds, along ``dim``: block
    ``b*q + a`` of q*q (the stream layout: the model's input), or ``b*q + c`` (``branch``:
    the logits' layout, for the targets).

    Plain slicing (data, no gradient to route back). ValueError naming the numbers unless
    q*q divides the batch.
    """
    q = cube.q
    check_cube_divisible(
        int(x.shape[dim]), q * q, what=f"batch (dim {dim} of {tuple(x.shape)})", where="batch_block"
    )
    return x.chunk(q * q, dim)[cube.b * q + (cube.c if branch else cube.a)]


def cross_entropy_3d(
    logits: Tensor,
    targets: Tensor,
    cube: Cube3D,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """The mean (or ``sum``) over the global batch of ``F.cross_entropy`` of the gathered logits.

    ``logits`` (..., vocab/q): batch block ``b*q + c``, vocabulary block a; ``targets``
    (...): the same batch block, global ids. Moves 2 all-reduces of per-token fp32 numbers
    along the a line and 2 of 2 numbers along the b and c lines; the loss is on every rank.
    """
    return blocked_cross_entropy(
        logits,
        targets,
        cube.input,
        [cube.weight, cube.output],
        ignore_index=ignore_index,
        reduction=reduction,
    )


def loss_3d(
    model: nn.Module, idx: Tensor, targets: Tensor, cube: Cube3D, *, ignore_index: int = -100
) -> Tensor:
    """The global mean next-token loss of a 3D-parallelized language model (e.g. the reference
    GPT under ``GPT_3D_PLAN``) on the global batch ``idx``, ``targets`` (batch first, the same
    on every rank): each rank runs its stream batch block; logits stay vocabulary-split."""
    logits = model(batch_block(idx, cube))
    return cross_entropy_3d(logits, batch_block(targets, cube, branch=True), cube, ignore_index=ignore_index)
