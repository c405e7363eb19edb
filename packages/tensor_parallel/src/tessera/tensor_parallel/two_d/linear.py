"""2D (SUMMA / Optimus) linear layer: ``Y_ij = sum_k X_ik W_kj`` over a q x q grid.

Rank (i, j) holds the activation block ``X_ij`` (batch block i, feature block j), the
weight block ``W_ij`` of the math weight ``W = linear.weight.T`` (in-features block i,
out-features block j; stored in nn.Linear layout as ``weight[out block j, in block i]``) and
produces ``Y_ij`` in the same layout as its input, so 2D layers chain without re-layout.

Forward (``summa_matmul``), for k = 0..q-1: broadcast ``X_ik`` along row i (from column k)
and ``W_kj`` along column j (from row k), accumulate ``X_ik W_kj``. Backward (the matching
reduces, as in Colossal-AI's ``Matmul_ABT_2D`` / ``Matmul_ATB_2D``):

- ``dX_ik = sum_j dY_ij W_kj^T``: broadcast ``W_kj`` along column j for every k, then reduce
  the q partials over row i, partial k to column k (one reduce-scatter: q reduces' bytes);
- ``dW_kj = sum_i X_ik^T dY_ij``: broadcast ``X_ik`` along row i again (nothing but the
  local blocks is saved, as in Colossal-AI), then reduce over column j, partial k to row k.

Overlap: each loop starts step k+1's broadcasts (``broadcast_async``) before it multiplies
step k's blocks, so the next blocks travel while this step computes (forward and backward);
backward's two reduce-scatters (over the row and the column) are in flight together. The
order of the broadcasts on each group, and so the bytes, are those of the plain loop.

The bias (out_features) is sharded over the whole grid as in Colossal-AI's ``add_bias_2d``:
rank (i, j) holds chunk ``j*q + i`` of q*q, all-gathered along column j in forward (giving
out block j) and its gradient reduce-scattered along the column in backward (the sum over
every batch row: exact, no replica to keep in sync).

Cost per rank, by ``CommMeter``'s paper accounting (a broadcast of S moves S, an all-gather
its output, a reduce-scatter its input), with ``|X| = tokens * in * e``, ``|W| = in * out * e``
and ``|b| = out * e`` the full (serial) tensors' bytes::

    forward  = (|X| + |W|) / q              + |b| / q
    backward = 2 (|X| + |W|) / q            + |b| / q

the Optimus / Colossal-AI SUMMA cost: q broadcasts of an ``|X|/q^2`` and a ``|W|/q^2`` block
forward, twice that backward (re-broadcasts plus the reduces). Exact: blocks never pad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Handle, all_gather_along, broadcast_async, reduce_scatter_async
from tessera.comm.ops import apply_function
from tessera.tensor_parallel.two_d.grid import Grid2D, GridShardSpec, check_grid_divisible

__all__ = ["BIAS_SPEC", "WEIGHT_SPEC", "Linear2D", "check_linear_2d", "summa_matmul"]

WEIGHT_SPEC = GridShardSpec(i_dim=1, j_dim=0)  # nn.Linear weight (out, in): out block j, in block i
BIAS_SPEC = GridShardSpec(i_dim=0, j_dim=0)  # q*q chunks, rank (i, j) holds chunk j*q + i


_Step = tuple[Handle[Tensor] | None, Handle[Tensor] | None]
"""The broadcasts of one SUMMA step in flight (None: not needed)."""


def _prefetched(q: int, issue: Callable[[int], _Step]) -> Iterator[tuple[Tensor | None, Tensor | None]]:
    """The blocks of steps 0..q-1, each yielded once its broadcasts (``issue(k)``) have arrived;
    step k+1's are started before step k's are yielded, so they travel while the caller
    multiplies step k's (at most two steps' blocks are alive at once)."""
    pending = issue(0)
    for k in range(q):
        current = pending
        if k + 1 < q:
            pending = issue(k + 1)
        yield _wait(current[0]), _wait(current[1])


def _wait(handle: Handle[Tensor] | None) -> Tensor | None:
    return None if handle is None else handle.wait()


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, grid: Grid2D) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.grid = grid
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_zeros(x2.shape[0], w.shape[0])

        def issue(k: int) -> _Step:  # X_ik from column k of row i, W_kj (out/q, in/q) from row k of column j
            return broadcast_async(x2, k, grid.row), broadcast_async(w, k, grid.col)

        for x_ik, w_kj in _prefetched(grid.q, issue):
            assert x_ik is not None and w_kj is not None
            y.addmm_(x_ik, w_kj.t())
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w = ctx.saved_tensors
        grid: Grid2D = ctx.grid
        gy2 = gy.reshape(-1, gy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        need_x, need_w = ctx.needs_input_grad[:2]

        def issue(k: int) -> _Step:  # W_kj along column j, X_ik along row i, as needed
            return (
                broadcast_async(w, k, grid.col) if need_x else None,
                broadcast_async(x2, k, grid.row) if need_w else None,
            )

        gx_parts: list[Tensor] = []  # partial k = dY_ij W_kj^T, summed over row i into column k
        gw_parts: list[Tensor] = []  # partial k = dY_ij^T X_ik (nn.Linear layout), over column j into row k
        for w_kj, x_ik in _prefetched(grid.q, issue):
            if w_kj is not None:
                gx_parts.append(gy2 @ w_kj)
            if x_ik is not None:
                gw_parts.append(gy2.t() @ x_ik)
        gx_h = reduce_scatter_async(torch.cat(gx_parts, dim=1), grid.row, dim=1) if need_x else None
        gw_h = reduce_scatter_async(torch.stack(gw_parts), grid.col, dim=0) if need_w else None
        gx = None if gx_h is None else gx_h.wait().view_as(x)
        gw = None if gw_h is None else gw_h.wait().squeeze(0)
        return gx, gw, None


def summa_matmul(x: Tensor, weight: Tensor, grid: Grid2D) -> Tensor:
    """``Y_ij = sum_k X_ik W_kj`` (``x @ weight.T`` of the serial tensors) from this rank's blocks:
    ``x`` (..., in/q) and ``weight`` (out/q, in/q) in nn.Linear layout; see the module for what
    forward and backward move."""
    return apply_function(_Summa, x, weight, grid)


class Linear2D(nn.Module):
    """A SUMMA linear layer over a q x q grid (see the module): input (..., in/q) of batch
    block i and feature block j, output (..., out/q) in the same layout.

    ``weight`` (out/q, in/q) is ``serial.weight[out block j, in block i]``; ``bias`` (out/q^2)
    is chunk ``j*q + i`` of the serial bias. Raises ValueError naming the numbers when q does
    not divide in_features or out_features (q*q for out_features with a bias).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        grid: Grid2D,
        *,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_linear_2d(in_features, out_features, grid.q, bias=bias, where="Linear2D")
        self.in_features, self.out_features, self.grid = in_features, out_features, grid
        q = grid.q
        self.weight = nn.Parameter(
            torch.empty(out_features // q, in_features // q, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features // (q * q), dtype=dtype, device=device)) if bias else None
        )

    @classmethod
    def from_dense(cls, linear: nn.Linear, grid: Grid2D) -> Linear2D:
        """The 2D twin of ``linear`` holding this rank's blocks of its weight and bias."""
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
            new.weight.copy_(WEIGHT_SPEC.shard(w, grid.tp_rank, tp))
            if linear.bias is not None and new.bias is not None:
                new.bias.copy_(BIAS_SPEC.shard(linear.bias, grid.tp_rank, tp))
        return new

    def forward(self, x: Tensor) -> Tensor:
        local_in = self.in_features // self.grid.q
        if x.dim() < 2 or x.shape[-1] != local_in:
            raise ValueError(
                f"Linear2D: expected input (..., in_features/q = {self.in_features}/{self.grid.q} = "
                f"{local_in}), got {tuple(x.shape)}"
            )
        y = summa_matmul(x, self.use_param(self.weight), self.grid)
        if self.bias is not None:
            # out block j; its gradient is reduce-scattered along the column
            y = y + all_gather_along(self.use_param(self.bias), 0, self.grid.col)
        return y

    def use_param(self, param: Tensor) -> Tensor:
        """``param`` as forward uses it: itself in 2D (the 2.5D subclass routes it through
        ``copy_to_region`` over the depth group, summing its gradient over the replicas)."""
        return param

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, q={self.grid.q}, "
            f"position=({self.grid.i}, {self.grid.j}), bias={self.bias is not None}"
        )


def check_linear_2d(in_features: int, out_features: int, q: int, *, bias: bool, where: str) -> None:
    """ValueError naming the numbers unless a q x q grid can split this linear layer."""
    check_grid_divisible(in_features, q, what="in_features", where=where)
    check_grid_divisible(out_features, q * q if bias else q, what="out_features", where=where)
