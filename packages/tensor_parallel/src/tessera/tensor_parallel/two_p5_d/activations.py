"""Activation bytes a rank saves for backward in the reference GPT under ``GPT_2P5D_PLAN``.

Inside a depth layer every layer is its 2D twin, so a rank saves exactly what a 2D rank
saves (``two_d.activations``) for its T = B*S/(q d) tokens (batch block ``k*q + i`` of
q*d): the 2D formulas with T divided by the depth d. The depth adds nothing saved (each
parameter's ``copy_to_region`` over ``tp_dep`` keeps no tensor). Only the token ids stay
8 B S: a rank's batch block is a view of the global batch it was handed.
"""

from __future__ import annotations

from tessera.tensor_parallel.activations import ActivationBytes
from tessera.tensor_parallel.two_d.activations import summa_activation_bytes
from tessera.tensor_parallel.two_d.grid import check_grid_divisible
from tessera.tensor_parallel.two_p5_d.grid import check_batch_2p5d

__all__ = ["activation_bytes_2p5d"]


def activation_bytes_2p5d(
    *, batch: int, seq: int, hidden: int, heads: int, vocab: int, q: int, depth: int, mlp_ratio: int = 4
) -> ActivationBytes:
    """The reference GPT's saved activation bytes per rank under ``GPT_2P5D_PLAN`` on a
    q x q x depth grid (module docstring); ValueError naming the numbers unless q*depth
    divides batch and q divides heads, vocab and hidden."""
    where = "activation_bytes_2p5d"
    check_batch_2p5d(batch, q, depth, where=where)
    for what, size in (("heads", heads), ("vocab", vocab), ("hidden", hidden)):
        check_grid_divisible(size, q, what=what, where=where)
    return summa_activation_bytes(
        tokens=batch * seq // (q * depth),
        batch=batch,
        seq=seq,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        q=q,
        mlp_ratio=mlp_ratio,
    )
