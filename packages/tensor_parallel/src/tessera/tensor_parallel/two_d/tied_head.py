"""A 2D LM head tied to a ``2d_vocab_embedding``: logits from the embedding's own table blocks.

``VocabEmbedding2D`` holds ``E[vocab block i, hidden block j]`` on rank (i, j); a
``Linear2D`` classifier would hold ``E[vocab block j, hidden block i]`` (nn.Linear layout,
out block j), a different cut, so one parameter cannot serve both. ``TiedClassifier2D``
keeps the embedding's cut and computes ``Y = X E^T`` as SUMMA's transposed product (as
Colossal-AI's ``Matmul_ABT_2D``): for each l, broadcast ``E_lj`` down column j from row l,
multiply ``X_ij E_lj^T`` (batch block i, vocab block l, a partial over hidden block j), then
one reduce-scatter over row i sums the partials and leaves rank (i, j) with vocab block j:
the classifier's layout, so ``cross_entropy_2d`` takes it unchanged. Backward is autograd's
adjoint of those collectives: each broadcast's gradient summed into its source row, the
reduce-scatter's gradient all-gathered along the row.

Cost per rank, ``|E|`` the serial table's bytes and ``|Y|`` the serial logits': forward
``|E|/q`` (q broadcasts of a block) ``+ |Y|/q`` (the reduce-scatter of q partials); backward
``|Y|/q`` (all-gather) ``+ 2|E|/q`` (the broadcasts' gradients, all-reduced along the column).
``TiedClassifier2p5D`` is the same in each depth layer, the table replicated over depth.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tessera.comm import all_gather_along, broadcast_from, reduce_scatter_along
from tessera.tensor_parallel.two_d.grid import Grid2D, check_grid_divisible
from tessera.tensor_parallel.two_d.linear import BIAS_SPEC
from tessera.tensor_parallel.two_d.vocab_embedding import VOCAB_EMBEDDING_SPEC
from tessera.tensor_parallel.two_p5_d.layers import depth_replica

__all__ = ["TiedClassifier2D", "TiedClassifier2p5D"]


class TiedClassifier2D(nn.Module):
    """``nn.Linear(hidden, vocab)`` whose weight is cut as ``VocabEmbedding2D``'s table
    (``weight[vocab block i, hidden block j]``), so it can be the same parameter. Input
    (..., hidden/q) of batch block i, hidden block j; output (..., vocab/q), vocab block j.
    ``bias`` (vocab/q^2) is chunk ``j*q + i`` (as ``Linear2D``'s). ValueError naming the numbers
    unless q divides vocab and hidden (q*q the vocab with a bias)."""

    def __init__(
        self,
        hidden: int,
        vocab: int,
        grid: Grid2D,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = grid.q
        check_grid_divisible(hidden, q, what="in_features (hidden)", where="TiedClassifier2D")
        check_grid_divisible(
            vocab, q * q if bias else q, what="out_features (vocab)", where="TiedClassifier2D"
        )
        self.in_features, self.out_features, self.grid = hidden, vocab, grid
        self.weight = nn.Parameter(torch.empty(vocab // q, hidden // q, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(vocab // (q * q), dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid2D) -> TiedClassifier2D:
        """The twin of ``linear`` (weight (vocab, hidden)) holding this rank's blocks."""
        w = linear.weight
        new = cls(
            linear.in_features,
            linear.out_features,
            grid,
            bias=linear.bias is not None,
            dtype=w.dtype,
            device=w.device,
        )
        tp = grid.q * grid.q
        with torch.no_grad():
            new.weight.copy_(VOCAB_EMBEDDING_SPEC.shard(w, grid.tp_rank, tp))
            if linear.bias is not None and new.bias is not None:
                new.bias.copy_(BIAS_SPEC.shard(linear.bias, grid.tp_rank, tp))
        return new

    def forward(self, x: Tensor) -> Tensor:
        grid, local = self.grid, self.in_features // self.grid.q
        if x.dim() < 2 or x.shape[-1] != local:
            raise ValueError(
                f"TiedClassifier2D: expected input (..., hidden/q = {self.in_features}/{grid.q} = {local}), "
                f"got {tuple(x.shape)}"
            )
        w = self.use_param(self.weight)
        x2 = x.reshape(-1, local)
        parts = [x2 @ broadcast_from(w, row, grid.col).t() for row in range(grid.q)]  # vocab block `row`
        y = reduce_scatter_along(torch.cat(parts, dim=1), 1, grid.row).view(*x.shape[:-1], -1)
        if self.bias is not None:
            y = y + all_gather_along(self.use_param(self.bias), 0, grid.col)
        return y

    def use_param(self, param: Tensor) -> Tensor:
        """``param`` as forward uses it: itself in 2D (2.5D: replicated over depth)."""
        return param

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q={self.grid.q}, tied"


class TiedClassifier2p5D(TiedClassifier2D):
    """``TiedClassifier2D`` in this rank's depth layer, its weight and bias replicated over
    depth (gradients all-reduced over ``tp_dep``), for a ``Grid2p5D``."""

    def use_param(self, param: Tensor) -> Tensor:
        return depth_replica(param, self.grid)
