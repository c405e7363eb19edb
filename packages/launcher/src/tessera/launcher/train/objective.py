"""What a rank trains on and how its loss is the global one, for each way of splitting a batch.

Data parallelism gives each dp rank its rows (the Engine does that). Then:

- 1D tensor parallelism: every tp rank sees the same rows; the logits are split over the
  vocabulary, and ``vocab_parallel_cross_entropy`` is exact over them.
- 2D tensor parallelism (q x q grid): rank (i, j) takes batch block i of the rows;
  ``cross_entropy_2d`` is exact over the grid's tokens. 2.5D (q x q x d): batch block
  k*q + i of q*d. 3D (q x q x q): the input block b*q + a of q*q, the targets in the logits'
  layout, block b*q + c.
- Context parallelism (cp ranks): each rank takes its slice of the sequence (contiguous or
  zigzag); the loss is its tokens' losses summed over cp (identity backward). Every cp
  rank's gradient is then a partial sum of the replica's gradient: ZeRO sums over dp x cp
  and averages over dp only.

**The built-in cross-entropy is a sum** (``Objective.sums``): the loss of a replica's
microbatch is the sum over its counted tokens (targets other than ``IGNORE_INDEX``, -100 as
in torch and Hugging Face labels), and the Engine divides it by the counted tokens of the
whole step, over every replica and microbatch (`StepLoss`). So the step trains, and reports,
the mean over every counted token of the global batch, as the serial model's
``F.cross_entropy`` over that batch does, however the ignored targets fall on ranks and
microbatches. A user's loss (``ModelSpec.loss``) is a mean over a rank's microbatch, and
every microbatch weighs the same: exact when each part counts the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from tessera.comm import Mesh, TPMode, reduce_from_region
from tessera.tensor_parallel import (
    Cube3D,
    Grid2D,
    Grid2p5D,
    batch_block,
    batch_block_2p5d,
    cross_entropy_2d,
    cross_entropy_2p5d,
    cross_entropy_3d,
    split_batch,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel.three_d import batch_block as batch_block_3d

__all__ = ["IGNORE_INDEX", "Loss", "Objective", "StepLoss", "objective"]

Loss = Callable[[Tensor, Tensor], Tensor]
IGNORE_INDEX = -100
"""A target that counts for nothing (padding, a masked prompt), as in ``F.cross_entropy``."""


@dataclass(frozen=True)
class Objective:
    """``shard`` turns a dp rank's ``(inputs, targets)`` into this rank's; ``loss(output,
    targets)`` is the loss of the replica's (micro)batch, the same on every rank of the
    replica: the sum over its counted tokens when ``sums``, else the user's mean."""

    shard: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    loss: Loss
    sums: bool = True


class StepLoss:
    """The loss each microbatch trains on: the objective's, scaled by ``scale`` when it is a
    sum, so that the microbatches' mean over every replica is the step's mean per counted
    token (see the module docstring). ``scale``: ``replicas * microbatches / counted`` for
    the step under way, set by the Engine before its first microbatch (`share`)."""

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        self.scale = 1.0

    def share(self, counted: float, parts: int) -> None:
        """Set the scale for a step of ``parts`` (replicas x microbatches) whose targets count
        ``counted`` tokens in all (a step that counts none trains on NaN, as ``F.cross_entropy``
        of such a batch is, and is skipped)."""
        self.scale = parts / counted if counted > 0 else float("nan")

    def __call__(self, output: Tensor, targets: Tensor) -> Tensor:
        loss = self.objective.loss(output, targets)
        return loss * self.scale if self.objective.sums else loss


def _multi_dimensional(mesh: Mesh) -> Objective:
    """The data split and loss of 2D, 2.5D and 3D tensor parallelism."""
    mode = mesh.topology.tp_mode
    if mode is TPMode.TWO_D:
        grid = Grid2D.from_mesh(mesh)
        return Objective(
            lambda x, y: (batch_block(x, grid), batch_block(y, grid)),
            lambda out, y: cross_entropy_2d(out, y, grid, reduction="sum"),
        )
    if mode is TPMode.TWO_P5_D:
        tess = Grid2p5D.from_mesh(mesh)
        return Objective(
            lambda x, y: (batch_block_2p5d(x, tess), batch_block_2p5d(y, tess)),
            lambda out, y: cross_entropy_2p5d(out, y, tess, reduction="sum"),
        )
    cube = Cube3D.from_mesh(mesh)
    return Objective(
        lambda x, y: (batch_block_3d(x, cube), batch_block_3d(y, cube, branch=True)),
        lambda out, y: cross_entropy_3d(out, y, cube, reduction="sum"),
    )


def objective(mesh: Mesh, *, cp_layout: str = "contiguous", loss: Loss | None = None) -> Objective:
    """The data split and the loss for ``mesh``'s degrees (see the module docstring).
    ``loss(output, targets)``: the user's mean loss over a rank's tokens, in place of the
    cross-entropy (1D tensor parallelism: the outputs are what the user's plan leaves, so
    vocab-split logits need a loss that knows it)."""
    if mesh.topology.tp_mode is not TPMode.ONE_D:
        mode = mesh.topology.tp_mode
        if mesh.size("cp") > 1:
            raise ValueError(f"{mode} tensor parallelism with context parallelism is not built")
        if loss is not None:
            raise ValueError(
                f"a custom loss with {mode} tensor parallelism: the logits are split over the grid and "
                "only its exact cross-entropy is built; use tp_mode 1d or the default loss"
            )
        return _multi_dimensional(mesh)
    tp_group, cp, sp_group = mesh.group("tp"), mesh.size("cp"), mesh.group("cp")

    def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:  # the sum over counted tokens
        flat = targets.flatten()
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), flat, tp_group, reduction="sum")

    one_d = loss if loss is not None else cross_entropy
    sums = loss is None

    if cp == 1:
        return Objective(lambda x, y: (x, y), one_d, sums)

    def sequence(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        a, b = split_batch(x, y, group=sp_group, layout=cp_layout)
        return a, b

    def over_cp(logits: Tensor, targets: Tensor) -> Tensor:
        if sums:
            return reduce_from_region(one_d(logits, targets), sp_group)
        tokens = targets.numel()  # a user's mean: every cp rank holds as many tokens
        return reduce_from_region(one_d(logits, targets) * tokens, sp_group) / (tokens * cp)

    return Objective(sequence, over_cp, sums)
