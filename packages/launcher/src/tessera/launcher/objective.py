"""What a rank trains on and how its loss is the global one, for each way of splitting a batch.

Data parallelism gives each dp rank its rows (the Engine does that). Then:

- 1D tensor parallelism: every tp rank sees the same rows; the logits are split over the
  vocabulary, and ``vocab_parallel_cross_entropy`` is the exact mean over them.
- 2D tensor parallelism (q x q grid): rank (i, j) takes batch block i of the rows;
  ``cross_entropy_2d`` is the exact mean over the grid's tokens.
- Context parallelism (sp ranks): each rank takes its slice of the sequence (contiguous or
  zigzag); the loss is the sum of its tokens' losses, summed over sp (identity backward),
  divided by the global token count. Every sp rank's gradient is then a partial sum of the
  replica's gradient: ZeRO sums over dp x sp and averages over dp only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from tessera.comm import Mesh, TPMode, reduce_from_region
from tessera.tensor_parallel import (
    GPT_2D_PLAN,
    GPT_PLAN,
    Grid2D,
    Plan,
    batch_block,
    cross_entropy_2d,
    split_batch,
    vocab_parallel_cross_entropy,
)

__all__ = ["Objective", "default_plan", "objective"]

Loss = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Objective:
    """``shard`` turns a dp rank's ``(inputs, targets)`` into this rank's; ``loss(output,
    targets)`` is the mean over the whole global (micro)batch, the same on every rank."""

    shard: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    loss: Loss


def default_plan(mesh: Mesh) -> Plan:
    """The reference GPT's plan for the mesh's tensor-parallel mode."""
    return GPT_2D_PLAN if mesh.topology.tp_mode is TPMode.TWO_D else GPT_PLAN


def objective(mesh: Mesh, *, sp_layout: str = "contiguous") -> Objective:
    """The data split and the loss for ``mesh``'s degrees (see the module docstring)."""
    if mesh.topology.tp_mode is TPMode.TWO_D:
        if mesh.size("sp") > 1:
            raise ValueError("2D tensor parallelism with context parallelism (sp > 1) is not built")
        grid = Grid2D.from_mesh(mesh)

        def block(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
            return batch_block(x, grid), batch_block(y, grid)

        return Objective(block, lambda out, y: cross_entropy_2d(out, y, grid))
    tp_group, sp, sp_group = mesh.group("tp"), mesh.size("sp"), mesh.group("sp")

    def one_d(logits: Tensor, targets: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), tp_group)

    if sp == 1:
        return Objective(lambda x, y: (x, y), one_d)

    def sequence(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        a, b = split_batch(x, y, group=sp_group, layout=sp_layout)
        return a, b

    def global_mean(logits: Tensor, targets: Tensor) -> Tensor:
        tokens = targets.numel()  # every sp rank holds as many tokens
        return reduce_from_region(one_d(logits, targets) * tokens, sp_group) / (tokens * sp)

    return Objective(sequence, global_mean)
