"""A mixture of experts whose output adds one trained bias: `OutputBiasMoE` (JetMoE's ``JetMoeMoE``,
whose ``bias [d]`` is added after the weighted sum of the experts' outputs).

The bias is not an expert's (it is added once per token, whatever the router chose), so it is
replicated as the router is: averaged over the data group under expert parallelism
(`tessera.moe.grads`). Under tensor parallelism inside the experts (`tessera.moe.split_hidden`)
it is added after the layer's tp region, to the output every tp rank holds:

- with sequence parallelism (one gather, along the sequence), each rank adds it to its own
  slice, so its gradient on each rank is that slice's, a partial sum over tp;
- without, every rank holds the same whole output, so the bias's gradient is taken on the
  group's first rank only (zeros on the others: every rank has a gradient, which the sum over
  the group flattens alike), so that the sum over tp, which a whole parameter inside a
  self-contained region takes (``tensor_parallel.coverage``), counts it once;
- 2D, 2.5D and 3D tensor parallelism, which leave each rank a block of the hidden, are refused
  (at the first call, naming the gathers): the bias would need cutting to that block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import group_rank
from tessera.moe.aux import scale_grad
from tessera.moe.layer import MoE

__all__ = ["OutputBiasMoE"]


class OutputBiasMoE(MoE):
    """`MoE` (same arguments) plus a trained output bias ``bias [d_model]`` (zeros at first),
    added to every token's output: ``MoE(x) + bias`` (module docstring). A post-norm is refused:
    which of the two comes first is a family's choice, and no family needs both yet."""

    def __init__(self, d_model: int, hidden: int, experts: int, top_k: int = 2, **kwargs: Any) -> None:
        if kwargs.get("post_norm_eps") is not None:
            raise ValueError(
                f"OutputBiasMoE takes no post-norm (post_norm_eps={kwargs['post_norm_eps']}): whether the "
                "bias is added before or after the norm is not defined"
            )
        super().__init__(d_model, hidden, experts, top_k, **kwargs)
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> Tensor:
        out = super().forward(x, input_ids)
        if self.tp == 1 or len(self.gathers) == 1:  # one rank, or each rank its own slice of the sequence
            return out + self.bias
        if self.gathers:
            raise ValueError(
                f"OutputBiasMoE under {len(self.gathers)} gathers (2D, 2.5D or 3D tensor parallelism, each "
                "rank a block of the hidden) is not supported: its output bias would need cutting to the "
                "block; use 1D tensor parallelism"
            )
        first = group_rank(self.tp_group) == 0  # the same whole output on every tp rank
        return out + scale_grad(self.bias, 1.0 if first else 0.0)
