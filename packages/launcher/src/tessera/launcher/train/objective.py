"""What a rank trains on and how its loss is the global one, for each way of splitting a batch.

Data parallelism gives each dp rank its rows (the Engine does that). Then the tensor-parallel
mode says what each of its ranks takes and its exact cross-entropy
(``tessera.tensor_parallel.modes.ModeSpec.objective``: 1D every rank the same rows over
vocab-split logits; 2D, 2.5D and 3D each rank its block of the rows). Context parallelism
(cp ranks, with a mode that keeps whole rows): each rank takes its slice of the sequence
(contiguous or zigzag); the loss is its tokens' losses summed over cp (identity backward).
Every cp rank's gradient is then a partial sum of the replica's gradient: ZeRO sums over
dp x cp and averages over dp only.

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

from tessera.comm import Mesh, reduce_from_region
from tessera.tensor_parallel import split_batch
from tessera.tensor_parallel.modes import mode_spec

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


def objective(mesh: Mesh, *, cp_layout: str = "contiguous", loss: Loss | None = None) -> Objective:
    """The data split and the loss for ``mesh``'s degrees (see the module docstring).
    ``loss(output, targets)``: the user's mean loss over a rank's tokens, in place of the
    mode's cross-entropy (only where every tp rank sees whole rows: the outputs are then what
    the user's plan leaves, so vocab-split logits need a loss that knows it)."""
    spec = mode_spec(mesh.topology.tp_mode)
    mode = spec.objective(mesh)
    cp, cp_group = mesh.size("cp"), mesh.group("cp")
    if not spec.whole_rows:
        if cp > 1:
            raise ValueError(f"{spec.mode} tensor parallelism with context parallelism is not built")
        if loss is not None:
            raise ValueError(
                f"a custom loss with {spec.mode} tensor parallelism: the logits are split over the grid and "
                "only its exact cross-entropy is built; use tp_mode 1d or the default loss"
            )
    own = loss if loss is not None else mode.loss
    sums = loss is None

    def rows(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return mode.inputs(x), mode.targets(y)

    if cp == 1:
        return Objective(rows, own, sums)

    def sequence(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        a, b = split_batch(x, y, group=cp_group, layout=cp_layout)
        return a, b

    def over_cp(logits: Tensor, targets: Tensor) -> Tensor:
        if sums:
            return reduce_from_region(own(logits, targets), cp_group)
        tokens = targets.numel()  # a user's mean: every cp rank holds as many tokens
        return reduce_from_region(own(logits, targets) * tokens, cp_group) / (tokens * cp)

    return Objective(sequence, over_cp, sums)
