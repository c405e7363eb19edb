"""2D LayerNorm over a hidden dimension split along the grid's rows (``tp_row``).

Rank (i, j) holds hidden block j of its batch block i. The per-token mean and variance are
exact: the mean from an all-reduce over the row of the local sums, then the variance from
an all-reduce of the local sums of squared deviations (two passes, as the serial LayerNorm
does, rather than E[x^2] - E[x]^2). Backward needs the per-token sums of the incoming
gradient and of its product with the normalised input over the whole hidden: one
all-reduce over the row of both. The affine weight and bias are sharded over the whole grid
like the 2D linear bias (rank (i, j) holds chunk ``j*q + i`` of q*q), all-gathered along the
column in forward and their gradients reduce-scattered along it in backward.

Cost per rank, with ``T`` local tokens (batch block i) in fp32 statistics and ``|w|`` the
serial weight's bytes: forward 2 all-reduces of ``T`` fp32 (16 T bytes by the paper
accounting) and all-gathers of ``2|w|/q``; backward one all-reduce of ``2T`` fp32 (16 T bytes)
and reduce-scatters of ``2|w|/q``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Group, all_gather_along, all_reduce
from tessera.comm.ops import apply_function
from tessera.tensor_parallel.two_d.grid import Grid2D, GridShardSpec, check_grid_divisible

__all__ = ["NORM_SPEC", "LayerNorm2D", "normalize_2d"]

NORM_SPEC = GridShardSpec(i_dim=0, j_dim=0)  # q*q chunks, rank (i, j) holds chunk j*q + i


class _Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, hidden: int, eps: float, row: Group) -> Tensor:
        xf = x.float()
        mean = all_reduce(xf.sum(-1, keepdim=True), row, inplace=True) / hidden
        centred = xf - mean
        var = all_reduce(centred.square().sum(-1, keepdim=True), row, inplace=True) / hidden
        rstd = (var + eps).rsqrt()
        xhat = centred * rstd
        ctx.save_for_backward(xhat, rstd)
        ctx.hidden, ctx.row, ctx.dtype = hidden, row, x.dtype
        return xhat.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        xhat, rstd = ctx.saved_tensors
        g = grad.float()
        sums = all_reduce(torch.stack([g.sum(-1), (g * xhat).sum(-1)]), ctx.row, inplace=True) / ctx.hidden
        gx = rstd * (g - sums[0].unsqueeze(-1) - xhat * sums[1].unsqueeze(-1))
        return gx.to(ctx.dtype), None, None, None


def normalize_2d(x: Tensor, hidden: int, row: Group, *, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over a hidden of size ``hidden`` split over ``row``
    (``x`` holds this rank's block of it, last dim); statistics in fp32, result in x's dtype."""
    return apply_function(_Normalize, x, hidden, eps, row)


class LayerNorm2D(nn.Module):
    """``nn.LayerNorm(hidden)`` on 2D activations (..., hidden/q): batch block i, hidden block j.

    ``weight`` and ``bias`` (hidden/q^2) are chunk ``j*q + i`` of the serial ones. Raises
    ValueError naming the numbers unless q*q divides hidden (q with no affine parameters).
    """

    def __init__(
        self,
        hidden: int,
        grid: Grid2D,
        *,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = grid.q
        check_grid_divisible(hidden, q * q if elementwise_affine else q, what="hidden", where="LayerNorm2D")
        self.hidden, self.grid, self.eps = hidden, grid, eps
        n = hidden // (q * q)
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device)) if elementwise_affine else None
        self.bias = (
            nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) if elementwise_affine and bias else None
        )

    @classmethod
    def from_dense(cls, norm: nn.LayerNorm, grid: Grid2D) -> LayerNorm2D:
        """The 2D twin of ``norm`` (1-D normalized_shape) holding this rank's chunks of its affine."""
        if len(norm.normalized_shape) != 1:
            raise ValueError(f"LayerNorm2D: normalized_shape must have one dim, got {norm.normalized_shape}")
        w, b = norm.weight, norm.bias
        new = cls(
            norm.normalized_shape[0],
            grid,
            eps=norm.eps,
            elementwise_affine=w is not None,
            bias=b is not None,
            dtype=None if w is None else w.dtype,
            device=None if w is None else w.device,
        )
        tp = grid.q * grid.q
        with torch.no_grad():
            if w is not None and new.weight is not None:
                new.weight.copy_(NORM_SPEC.shard(w, grid.tp_rank, tp))
            if b is not None and new.bias is not None:
                new.bias.copy_(NORM_SPEC.shard(b, grid.tp_rank, tp))
        return new

    def forward(self, x: Tensor) -> Tensor:
        local = self.hidden // self.grid.q
        if x.shape[-1] != local:
            raise ValueError(
                f"LayerNorm2D: expected input (..., hidden/q = {self.hidden}/{self.grid.q} = {local}), "
                f"got {tuple(x.shape)}"
            )
        y = normalize_2d(x, self.hidden, self.grid.row, eps=self.eps)
        if self.weight is not None:
            y = y * all_gather_along(self.use_param(self.weight), 0, self.grid.col)
        if self.bias is not None:
            y = y + all_gather_along(self.use_param(self.bias), 0, self.grid.col)
        return y

    def use_param(self, param: Tensor) -> Tensor:
        """``param`` as forward uses it: itself in 2D (the 2.5D subclass routes it through
        ``copy_to_region`` over the depth group, summing its gradient over the replicas)."""
        return param

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.grid.q}, eps={self.eps}, affine={self.weight is not None}"
