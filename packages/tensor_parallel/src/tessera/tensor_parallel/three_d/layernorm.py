"""3D LayerNorm over a hidden dimension split along one line of the cube.

In the stream layout (see ``linear``) rank (a, b, c) holds hidden block c of batch block
``b*q + a``; the per-token mean and variance are exact, from all-reduces of local sums over
the ``tp_output`` line (c), two passes as in the serial LayerNorm (``normalize_2d``, shared
with 2D: the statistics only need the group that splits the hidden). With ``swapped`` the
input is in the branch layout (hidden block a, reduced over ``tp_input``).

The affine weight and bias are cut q**3 ways: rank (a, b, c) holds chunk ``(h*q + b)*q + o``
(h the hidden axis, o the other of a and c; in the stream layout that is its tp rank), all-
gathered along o then b to give hidden block h, their gradients reduce-scattered back: exact.

Cost per rank, ``T`` local tokens, fp32 statistics, ``|w|`` the serial weight's bytes:
forward 2 all-reduces of ``T`` fp32 (16 T by the paper accounting) + ``2|w| (1/q + 1/q^2)``
of all-gathers; backward one all-reduce of ``2T`` fp32 (16 T) + ``2|w| (1/q + 1/q^2)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tessera.comm import all_gather_along
from tessera.tensor_parallel.three_d.cube import Cube3D, CubeShardSpec, check_cube_divisible
from tessera.tensor_parallel.two_d.layernorm import normalize_2d

__all__ = ["LayerNorm3D", "norm_spec"]


def _axes(swapped: bool) -> tuple[str, str]:
    """(hidden axis h, other axis o) of the layout: stream (c, a), branch (a, c)."""
    return ("a", "c") if swapped else ("c", "a")


def norm_spec(swapped: bool = False) -> CubeShardSpec:
    """Norm weight / bias (hidden): chunk ``(h*q + b)*q + o`` of q**3."""
    h, o = _axes(swapped)
    return CubeShardSpec(split=(h + "b" + o,))


class LayerNorm3D(nn.Module):
    """``nn.LayerNorm(hidden)`` on 3D activations (batch/q^2, ..., hidden/q) in the stream
    layout (branch if ``swapped``). ``weight`` and ``bias`` (hidden/q^3) are shards by
    ``norm_spec``. ValueError naming the numbers unless q^3 divides hidden (q without affine)."""

    def __init__(
        self,
        hidden: int,
        cube: Cube3D,
        *,
        swapped: bool = False,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        q = cube.q
        check_cube_divisible(hidden, q**3 if elementwise_affine else q, what="hidden", where="LayerNorm3D")
        self.hidden, self.cube, self.swapped, self.eps = hidden, cube, swapped, eps
        n = hidden // q**3
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device)) if elementwise_affine else None
        self.bias = (
            nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) if elementwise_affine and bias else None
        )

    @classmethod
    def from_dense(cls, norm: nn.LayerNorm, cube: Cube3D, *, swapped: bool = False) -> LayerNorm3D:
        """The 3D twin of ``norm`` (1-D normalized_shape) holding this rank's affine chunks."""
        if len(norm.normalized_shape) != 1:
            raise ValueError(f"LayerNorm3D: normalized_shape must have one dim, got {norm.normalized_shape}")
        w, b = norm.weight, norm.bias
        new = cls(
            norm.normalized_shape[0],
            cube,
            swapped=swapped,
            eps=norm.eps,
            elementwise_affine=w is not None,
            bias=b is not None,
            dtype=None if w is None else w.dtype,
            device=None if w is None else w.device,
        )
        spec, tp = norm_spec(swapped), cube.q**3
        with torch.no_grad():
            if w is not None and new.weight is not None:
                new.weight.copy_(spec.shard(w, cube.tp_rank, tp))
            if b is not None and new.bias is not None:
                new.bias.copy_(spec.shard(b, cube.tp_rank, tp))
        return new

    def _gather(self, p: Tensor) -> Tensor:
        _, o = _axes(self.swapped)
        return all_gather_along(all_gather_along(p, 0, self.cube.group(o)), 0, self.cube.weight)

    def forward(self, x: Tensor) -> Tensor:
        local = self.hidden // self.cube.q
        if x.shape[-1] != local:
            raise ValueError(
                f"LayerNorm3D: expected input (..., hidden/q = {self.hidden}/{self.cube.q} = {local}), "
                f"got {tuple(x.shape)}"
            )
        h, _ = _axes(self.swapped)
        y = normalize_2d(x, self.hidden, self.cube.group(h), eps=self.eps)
        if self.weight is not None:
            y = y * self._gather(self.weight)
        if self.bias is not None:
            y = y + self._gather(self.bias)
        return y

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, q={self.cube.q}, swapped={self.swapped}, eps={self.eps}, "
            f"affine={self.weight is not None}"
        )
