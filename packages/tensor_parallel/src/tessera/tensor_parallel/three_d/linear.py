"""3D linear layer (Agarwal et al.'s 3D matmul, as Colossal-AI's legacy ``Linear3D``).

Activations (batch, ..., hidden) have two layouts on the cube (a, b, c), both with the
batch in q*q blocks and the hidden in q blocks (``X`` is cut over all three axes):

- *stream* (embeddings, norms, the residual stream): batch block ``b*q + a``, hidden block c;
- *branch* (inside attention and the MLP, the logits): batch block ``b*q + c``, hidden block a.

``Linear3D`` maps stream to branch (``swapped=False``: gather axis g = a, scatter axis s = c)
or, swapped, branch to stream (g = c, s = a); so two in a row (q/k/v then out_proj, fc_in
then fc_out) come back to the stream. With ``W = linear.weight.T`` (in x out), rank (a, b, c)
holds ``weight[out chunk g*q + b of q*q, in block s]``, and:

- forward: all-gather X along the g line (batch block b, hidden block s), all-gather the
  weight along the b line (``weight[out block g, in block s]``), multiply locally (a partial
  sum over in-block s), reduce-scatter the product along the s line over the batch: rank
  (a, b, c) gets batch block ``b*q + s``, out block g;
- backward, the conjugates: all-gather dY along s; ``dX = dY W^T`` reduce-scattered along g
  over the batch; ``dW = X^T dY`` reduce-scattered along b over the out features. The
  gathered X and W are kept from forward (Colossal-AI's choice: memory for communication).

The bias (out) is cut q**3 ways, rank (a, b, c) holding chunk ``(g*q + b)*q + s``; it is
all-gathered along s then along b (giving out block g), and its gradient reduce-scattered
back: exact, no replica to keep in sync.

Cost per rank by ``CommMeter``'s paper accounting (all-gather: its output, reduce-scatter: its
input), ``|X| = tokens*in*e``, ``|W| = in*out*e``, ``|Y| = tokens*out*e``, ``|b| = out*e``
the serial tensors' bytes::

    forward  = (|X| + |W| + |Y|) / q**2 + |b| (1/q + 1/q**2)
    backward = (|X| + |W| + |Y|) / q**2 + |b| (1/q + 1/q**2)

exact (blocks never pad); the 3D bound O(|.|/q**2) per rank, against 2D's O(|.|/q).

A linear that *returns* (``returns=True``: an adapter's down projection ``lora_A``, in -> r)
moves its output back to its input's layout (``mirror``: rank (a, b, c) and its mirror swap
their blocks), so that ``lora_B``, oriented as the base layer, maps it where the base layer's
output lies. The move all-gathers the r-wide output along g (its hidden) then along s (its
batch) and keeps this rank's block: ``|H| (1/q**2 + 1/q)`` more per rank for ``|H| =
tokens*r*e``, small beside the base layer's bytes while r is small beside the layer's width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import all_gather, all_gather_along, reduce_scatter
from tessera.comm.ops import apply_function
from tessera.tensor_parallel.three_d.cube import Cube3D, CubeShardSpec, check_cube_divisible

__all__ = [
    "Linear3D",
    "bias_spec",
    "check_linear_3d",
    "gather_bias",
    "linear_3d",
    "linear_axes",
    "mirror",
    "weight_spec",
]


def linear_axes(swapped: bool) -> tuple[str, str]:
    """(gather axis g, scatter axis s) of a linear layer: (a, c), or (c, a) when swapped."""
    return ("c", "a") if swapped else ("a", "c")


def weight_spec(swapped: bool) -> CubeShardSpec:
    """nn.Linear weight (out, in): out chunk ``g*q + b``, in block s."""
    g, s = linear_axes(swapped)
    return CubeShardSpec(split=(g + "b", s))


def bias_spec(swapped: bool) -> CubeShardSpec:
    """Bias (out): chunk ``(g*q + b)*q + s`` of q**3."""
    g, s = linear_axes(swapped)
    return CubeShardSpec(split=(g + "b" + s,))


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, cube: Cube3D, swapped: bool) -> Tensor:
        g, s = linear_axes(swapped)
        xg = all_gather(x, cube.group(g), 0)  # batch block b, in block s
        wg = all_gather(w, cube.weight, 0)  # (out/q, in/q): out block g, in block s
        ctx.save_for_backward(xg, wg)
        ctx.cube, ctx.swapped = cube, swapped
        return reduce_scatter(xg @ wg.t(), cube.group(s), 0)  # partial over in-block s, summed

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        xg, wg = ctx.saved_tensors
        cube: Cube3D = ctx.cube
        g, s = linear_axes(ctx.swapped)
        gyg = all_gather(gy.contiguous(), cube.group(s), 0)  # batch block b, out block g
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = reduce_scatter(gyg @ wg, cube.group(g), 0)
        if ctx.needs_input_grad[1]:
            partial = gyg.reshape(-1, gyg.shape[-1]).t() @ xg.reshape(-1, xg.shape[-1])
            gw = reduce_scatter(partial, cube.weight, 0)
        return gx, gw, None, None


def linear_3d(x: Tensor, weight: Tensor, cube: Cube3D, *, swapped: bool = False) -> Tensor:
    """``x @ weight.T`` of the serial tensors from this rank's blocks (see the module):
    ``x`` (batch/q^2, ..., in/q) in the stream layout (branch if ``swapped``), ``weight``
    (out/q^2, in/q); the result (batch/q^2, ..., out/q) is in the other layout."""
    return apply_function(_Linear3D, x, weight, cube, swapped)


def mirror(y: Tensor, cube: Cube3D, *, swapped: bool) -> Tensor:
    """A linear's output (``linear_3d(..., swapped=swapped)``: batch block ``b*q + s``, hidden
    block g) in that linear's input layout (batch block ``b*q + g``, hidden block s): gathered
    along g over the hidden, along s over the batch, this rank's block kept; backward the
    reduce-scatters of the gradient (exact: each element has one consumer)."""
    g, s = linear_axes(swapped)
    q = cube.q
    whole = all_gather_along(all_gather_along(y, y.dim() - 1, cube.group(g)), 0, cube.group(s))
    rows, cols = whole.shape[0] // q, whole.shape[-1] // q
    return whole.narrow(0, cube.coord(g) * rows, rows).narrow(-1, cube.coord(s) * cols, cols)


def gather_bias(bias: Tensor, cube: Cube3D, *, swapped: bool) -> Tensor:
    """Out block g of a bias held as chunk ``(g*q + b)*q + s``: all-gathers along s then b
    (|b|/q^2 + |b|/q); backward reduce-scatters the gradient back (the same bytes)."""
    s = linear_axes(swapped)[1]
    return all_gather_along(all_gather_along(bias, 0, cube.group(s)), 0, cube.weight)


class Linear3D(nn.Module):
    """A 3D linear layer over a q x q x q cube (see the module): input (batch/q^2, ...,
    in/q) in the stream layout, output (batch/q^2, ..., out/q) in the branch layout
    (the reverse when ``swapped``); with ``returns``, back in the input's layout (``mirror``).

    ``weight`` (out/q^2, in/q) and ``bias`` (out/q^3) are this rank's shards by
    ``weight_spec(swapped)`` and ``bias_spec(swapped)``. Raises ValueError naming the numbers
    unless q divides in_features and q^2 out_features (q^3 with a bias).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        cube: Cube3D,
        *,
        swapped: bool = False,
        returns: bool = False,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_linear_3d(in_features, out_features, cube.q, bias=bias, where="Linear3D")
        self.in_features, self.out_features = in_features, out_features
        self.cube, self.swapped, self.returns = cube, swapped, returns
        q = cube.q
        self.weight = nn.Parameter(
            torch.empty(out_features // q**2, in_features // q, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features // q**3, dtype=dtype, device=device)) if bias else None
        )

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, cube: Cube3D, *, swapped: bool = False, returns: bool = False
    ) -> Linear3D:
        """The 3D twin of ``linear`` holding this rank's shards of its weight and bias."""
        w = linear.weight
        new = cls(
            linear.in_features,
            linear.out_features,
            cube,
            swapped=swapped,
            returns=returns,
            bias=linear.bias is not None,
            dtype=w.dtype,
            device=w.device,
        )
        tp = cube.q**3
        with torch.no_grad():
            new.weight.copy_(weight_spec(swapped).shard(w, cube.tp_rank, tp))
            if linear.bias is not None and new.bias is not None:
                new.bias.copy_(bias_spec(swapped).shard(linear.bias, cube.tp_rank, tp))
        return new

    def forward(self, x: Tensor) -> Tensor:
        local_in = self.in_features // self.cube.q
        if x.dim() < 2 or x.shape[-1] != local_in:
            raise ValueError(
                f"Linear3D: expected input (batch/q^2, ..., in_features/q = {self.in_features}/"
                f"{self.cube.q} = {local_in}), got {tuple(x.shape)}"
            )
        y = linear_3d(x, self.weight, self.cube, swapped=self.swapped)
        if self.bias is not None:
            y = y + gather_bias(self.bias, self.cube, swapped=self.swapped)
        return mirror(y, self.cube, swapped=self.swapped) if self.returns else y

    def extra_repr(self) -> str:
        cube = self.cube
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, q={cube.q}, "
            f"position=({cube.a}, {cube.b}, {cube.c}), swapped={self.swapped}, "
            f"{'returns=True, ' if self.returns else ''}bias={self.bias is not None}"
        )


def check_linear_3d(in_features: int, out_features: int, q: int, *, bias: bool, where: str) -> None:
    """ValueError naming the numbers unless a q x q x q cube can split this linear layer."""
    check_cube_divisible(in_features, q, what="in_features", where=where)
    check_cube_divisible(out_features, q**3 if bias else q**2, what="out_features", where=where)
