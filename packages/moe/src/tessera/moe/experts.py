"""A bank of expert MLPs stored as stacked weights, run grouped or one expert at a time.

``w1 [n, d, h]`` and ``w2 [n, h, d]`` (and ``w3 [n, d, h]`` for SwiGLU) hold ``n`` experts.
SwiGLU computes ``(silu(x @ w1) * (x @ w3)) @ w2``, GELU ``gelu(x @ w1) @ w2``; no biases.
The input rows arrive sorted by expert with ``counts[i]`` rows for the bank's expert ``i``.
The grouped path scatters them into a ``[n, max(counts), d]`` batch (zero padding) and runs
one batched matmul per weight; the loop path (the reference) runs each expert on its slice.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.moe.init import generator, uniform

__all__ = ["ACTIVATIONS", "Activation", "Experts"]

Activation = Literal["swiglu", "gelu"]
ACTIVATIONS: tuple[Activation, ...] = ("swiglu", "gelu")


def _expert_weights(d: int, h: int, activation: Activation, gen: torch.Generator) -> list[Tensor]:
    w = [uniform((d, h), d, gen), uniform((h, d), h, gen)]
    if activation == "swiglu":
        w.append(uniform((d, h), d, gen))
    return w


class Experts(nn.Module):
    """``n`` expert MLPs ``d -> h -> d`` with stacked weights; expert ``i`` of the bank is
    drawn from stream ``streams[i]`` of ``seed`` (`tessera.moe.init`)."""

    w3: nn.Parameter | None

    def __init__(
        self, d_model: int, hidden: int, activation: Activation, *, seed: int, streams: list[int]
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if d_model < 1 or hidden < 1:
            raise ValueError(f"d_model and hidden must be >= 1, got d_model={d_model}, hidden={hidden}")
        self.activation: Activation = activation
        per_expert = [_expert_weights(d_model, hidden, activation, generator(seed, s)) for s in streams]
        self.w1 = nn.Parameter(torch.stack([w[0] for w in per_expert]))
        self.w2 = nn.Parameter(torch.stack([w[1] for w in per_expert]))
        self.w3 = nn.Parameter(torch.stack([w[2] for w in per_expert])) if activation == "swiglu" else None

    @property
    def count(self) -> int:
        """How many experts the bank holds."""
        return self.w1.shape[0]

    def keep(self, start: int, stop: int) -> None:
        """Keep only experts ``start:stop`` of the bank (new parameters holding copies, frozen
        where the bank's were)."""
        for name in ("w1", "w2", "w3"):
            w = getattr(self, name)
            if w is not None:
                part = w.detach()[start:stop].clone()
                setattr(self, name, nn.Parameter(part, requires_grad=w.requires_grad))

    def keep_hidden(self, start: int, stop: int) -> None:
        """Keep only hidden units ``start:stop`` of every expert (``w1`` / ``w3`` columns,
        ``w2`` rows; new parameters holding copies, frozen where the bank's were): the bank
        then computes, per expert, its share of the output, which summed over the shares is the
        whole expert's."""
        for name, dim in (("w1", 2), ("w2", 1), ("w3", 2)):
            w = getattr(self, name)
            if w is not None:
                part = w.detach().narrow(dim, start, stop - start).clone()
                setattr(self, name, nn.Parameter(part, requires_grad=w.requires_grad))

    @property
    def hidden(self) -> int:
        """The hidden width each expert holds (its share under tensor parallelism)."""
        return self.w1.shape[2]

    def _mlp(self, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None) -> Tensor:
        """The MLP on ``x [..., m, d]`` with weights batched like ``x``'s leading dims."""
        up = x @ w1
        if w3 is None:
            return F.gelu(up) @ w2
        return (F.silu(up) * (x @ w3)) @ w2

    def expert(self, i: int, x: Tensor) -> Tensor:
        """Run rows ``x [m, d]`` through the bank's expert ``i``."""
        return self._mlp(x, self.w1[i], self.w2[i], None if self.w3 is None else self.w3[i])

    def forward(self, x: Tensor, counts: Tensor, *, grouped: bool = True) -> Tensor:
        """Run rows ``x [sum(counts), d]``, sorted by expert, through their experts."""
        if counts.shape != (self.count,) or int(counts.sum()) != x.shape[0]:
            raise ValueError(
                f"counts {counts.tolist()} must give one count per expert ({self.count}) summing "
                f"to the rows of x ({x.shape[0]})"
            )
        return self._grouped(x, counts) if grouped else self._loop(x, counts)

    def _loop(self, x: Tensor, counts: Tensor) -> Tensor:
        pieces = torch.split(x, counts.tolist())
        out = [self.expert(i, piece) for i, piece in enumerate(pieces)]
        return torch.cat(out)

    def _grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        n, rows = self.count, x.shape[0]
        width = int(counts.max()) if n else 0
        expert = torch.repeat_interleave(torch.arange(n, device=x.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = expert * width + torch.arange(rows, device=x.device) - starts[expert]
        batch = x.new_zeros(n * width, x.shape[1]).index_copy(0, slot, x).view(n, width, x.shape[1])
        out = self._mlp(batch, self.w1, self.w2, self.w3)
        return out.reshape(n * width, out.shape[-1]).index_select(0, slot)
