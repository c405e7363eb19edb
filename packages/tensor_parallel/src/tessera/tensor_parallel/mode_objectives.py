"""What each tensor-parallel mode trains on and its exact loss: a `ModeObjective` per mode.

1D: every tp rank takes the same rows; the logits are split over the vocabulary and
``vocab_parallel_cross_entropy`` is exact over them. 2D (q x q grid): rank (i, j) takes batch
block i of the rows, ``cross_entropy_2d``. 2.5D (q x q x d): batch block k*q + i of q*d,
``cross_entropy_2p5d``. 3D (q x q x q): the input block b*q + a of q*q, the targets in the logits'
layout (block b*q + c), ``cross_entropy_3d``. Every loss is the sum over the counted targets
(``ignore_index`` -100), the same on every rank of the mode's group. `ModeSpec.objective` holds the
mode's builder, so a caller asks the mode instead of branching on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from tessera.comm import Mesh
from tessera.tensor_parallel.loss import vocab_parallel_cross_entropy
from tessera.tensor_parallel.three_d.cube import Cube3D
from tessera.tensor_parallel.three_d.loss import batch_block as batch_block_3d
from tessera.tensor_parallel.three_d.loss import cross_entropy_3d
from tessera.tensor_parallel.two_d.grid import Grid2D
from tessera.tensor_parallel.two_d.loss import batch_block, cross_entropy_2d
from tessera.tensor_parallel.two_p5_d.grid import Grid2p5D
from tessera.tensor_parallel.two_p5_d.loss import batch_block_2p5d, cross_entropy_2p5d

__all__ = ["ModeObjective", "objective_1d", "objective_2d", "objective_2p5d", "objective_3d"]

Split = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ModeObjective:
    """This rank's share of a replica's ``inputs`` and ``targets`` (each taken alone, so a
    pipeline rank holding one of them splits it), and the exact summed cross-entropy of the
    mode's logits against this rank's targets."""

    inputs: Split
    targets: Split
    loss: Callable[[Tensor, Tensor], Tensor]


def _whole(x: Tensor) -> Tensor:
    return x


def objective_1d(mesh: Mesh) -> ModeObjective:
    group = mesh.group("tp")

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), group, reduction="sum")

    return ModeObjective(_whole, _whole, loss)


def objective_2d(mesh: Mesh) -> ModeObjective:
    grid = Grid2D.from_mesh(mesh)
    return ModeObjective(
        lambda x: batch_block(x, grid),
        lambda y: batch_block(y, grid),
        lambda out, y: cross_entropy_2d(out, y, grid, reduction="sum"),
    )


def objective_2p5d(mesh: Mesh) -> ModeObjective:
    grid = Grid2p5D.from_mesh(mesh)
    return ModeObjective(
        lambda x: batch_block_2p5d(x, grid),
        lambda y: batch_block_2p5d(y, grid),
        lambda out, y: cross_entropy_2p5d(out, y, grid, reduction="sum"),
    )


def objective_3d(mesh: Mesh) -> ModeObjective:
    cube = Cube3D.from_mesh(mesh)
    return ModeObjective(
        lambda x: batch_block_3d(x, cube),
        lambda y: batch_block_3d(y, cube, branch=True),
        lambda out, y: cross_entropy_3d(out, y, cube, reduction="sum"),
    )
