"""A bank of expert MLPs stored as stacked weights, run grouped or one expert at a time.

``w1 [n, d, h]`` and ``w2 [n, h, d]`` (and ``w3 [n, d, h]`` for a gated activation) hold ``n``
experts. A gated one computes ``act(x @ w1, x @ w3) @ w2`` (SwiGLU: ``silu(g) * u``; GPT-OSS's
`ClampedSwiGLU`, and the clamped and softcapped `SwiGLUVariant`), a non-gated one ``act(x @ w1)
@ w2`` (GELU, ReLU², `tessera.moe.activations`). With ``bias=True`` each projection has a
bias (``b1 [n, h]``, ``b3 [n, h]``, ``b2 [n, d]``, zeros at first), else none. With
``norm_eps`` each expert's output rows are RMS-normalised with that expert's own weight
``norm [n, d]`` (ones at first; `tessera.moe.norms`), which a split over tp refuses.
The input rows arrive sorted by expert with ``counts[i]`` rows for the bank's expert ``i``.
The grouped path scatters them into a ``[n, max(counts), d]`` batch (zero padding) and runs
one batched matmul per weight; the loop path (the reference) runs each expert on its slice.
Low-rank adapters in ``adapters`` (`tessera.moe.adapters`) add their deltas to the weights the
bank computes with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tessera.moe.activations import (
    ACTIVATIONS,
    Activation,
    ClampedSwiGLU,
    SwiGLUVariant,
    activate,
    check_activation,
    is_gated,
)
from tessera.moe.adapters import ExpertAdapter, deltas
from tessera.moe.init import generator, uniform
from tessera.moe.norms import norm_split_problem, normalised

__all__ = ["ACTIVATIONS", "Activation", "ClampedSwiGLU", "Experts", "SwiGLUVariant"]


def _expert_weights(d: int, h: int, activation: Activation, gen: torch.Generator) -> list[Tensor]:
    w = [uniform((d, h), d, gen), uniform((h, d), h, gen)]
    if is_gated(activation):
        w.append(uniform((d, h), d, gen))
    return w


class Experts(nn.Module):
    """``n`` expert MLPs ``d -> h -> d`` with stacked weights (and biases, with ``bias``);
    expert ``i`` of the bank is drawn from stream ``streams[i]`` of ``seed`` (`tessera.moe.init`).

    Split over tp (`keep_hidden`), each share adds ``out_bias_share`` of ``b2``: all of it in
    the share holding hidden unit 0, none in the others, so the sum over the shares adds it once
    (its gradient whole on that rank, zero on the others: summed over tp as any whole one's)."""

    w3: nn.Parameter | None
    b1: nn.Parameter | None
    b2: nn.Parameter | None
    b3: nn.Parameter | None
    norm: nn.Parameter | None

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: Activation,
        *,
        seed: int,
        streams: list[int],
        bias: bool = False,
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        check_activation(activation)
        if d_model < 1 or hidden < 1:
            raise ValueError(f"d_model and hidden must be >= 1, got d_model={d_model}, hidden={hidden}")
        if norm_eps is not None and not (math.isfinite(norm_eps) and norm_eps > 0):
            raise ValueError(f"an expert norm's epsilon must be finite and > 0 (or None), got {norm_eps}")
        self.activation: Activation = activation
        per_expert = [_expert_weights(d_model, hidden, activation, generator(seed, s)) for s in streams]
        self.w1 = nn.Parameter(torch.stack([w[0] for w in per_expert]))
        self.w2 = nn.Parameter(torch.stack([w[1] for w in per_expert]))
        self.w3 = nn.Parameter(torch.stack([w[2] for w in per_expert])) if is_gated(activation) else None
        n = len(streams)
        self.b1 = nn.Parameter(torch.zeros(n, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(n, d_model)) if bias else None
        self.b3 = nn.Parameter(torch.zeros(n, hidden)) if bias and self.w3 is not None else None
        self.norm_eps = norm_eps
        self.norm = None if norm_eps is None else nn.Parameter(torch.ones(n, d_model))
        self.out_bias_share = 1.0  # `keep_hidden`: 0 in a share without hidden unit 0
        self.adapters = nn.ModuleDict()  # adapter name -> {key -> ExpertAdapter} (`add_adapter`)

    def add_adapter(self, name: str, adapter: ExpertAdapter, *, key: str | None = None) -> None:
        """Add ``adapter`` under adapter name ``name`` and ``key`` (default: its ``site``; two
        adapters of one name at one site, such as a gate's and an up projection's, take keys
        of their own); ValueError if the key is taken or the adapter does not fit the bank."""
        d, h = self.w1.shape[1], self.w1.shape[2]
        n, _, width = adapter.down.shape
        want_in = d if adapter.site == "in" else h
        outs = {w: int(u.shape[1]) for w, u in adapter.up.items()}
        wanted = {w: h if w in ("w1", "w3") else d for w in outs}
        if n != self.count or width != want_in or outs != wanted or ("w3" in outs and self.w3 is None):
            raise ValueError(
                f"adapter {name!r} at site {adapter.site!r}: down {tuple(adapter.down.shape)} and ups "
                f"{outs} do not fit a bank of {self.count} experts d={d} -> h={h} ({self.activation})"
            )
        key = adapter.site if key is None else key
        keys = self.adapters[name] if name in self.adapters else nn.ModuleDict()
        assert isinstance(keys, nn.ModuleDict)
        if key in keys:
            raise ValueError(f"the bank already has adapter {name!r} under {key!r}")
        keys[key] = adapter
        self.adapters[name] = keys

    def _adapters(self) -> list[ExpertAdapter]:
        found = [
            a for keys in self.adapters.values() if isinstance(keys, nn.ModuleDict) for a in keys.values()
        ]
        return [a for a in found if isinstance(a, ExpertAdapter)]

    def weights(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(w1, w2, w3)`` as the bank computes with them: each weight plus its adapters' deltas."""
        adapters = self._adapters()
        if not adapters:
            return self.w1, self.w2, self.w3
        w1 = deltas(self.w1, (a.delta("w1") for a in adapters))
        w2 = deltas(self.w2, (a.delta("w2") for a in adapters))
        w3 = None if self.w3 is None else deltas(self.w3, (a.delta("w3") for a in adapters))
        return w1, w2, w3

    @property
    def count(self) -> int:
        """How many experts the bank holds."""
        return self.w1.shape[0]

    def keep(self, start: int, stop: int) -> None:
        """Keep only experts ``start:stop`` of the bank (new parameters holding copies, frozen
        where the bank's were)."""
        for name in ("w1", "w2", "w3", "b1", "b2", "b3", "norm"):
            w = getattr(self, name)
            if w is not None:
                part = w.detach()[start:stop].clone()
                setattr(self, name, nn.Parameter(part, requires_grad=w.requires_grad))
        for adapter in self._adapters():
            adapter.keep(start, stop)

    def keep_hidden(self, start: int, stop: int) -> None:
        """Keep only hidden units ``start:stop`` of every expert (``w1`` / ``w3`` columns,
        ``w2`` rows; new parameters holding copies, frozen where the bank's were): the bank
        then computes, per expert, its share of the output, which summed over the shares is the
        whole expert's (``b2`` is kept whole, added by the share holding hidden unit 0 only).
        Refuses a bank that normalises its experts' outputs (a norm of a partial sum is not the
        norm of the sum)."""
        if self.norm is not None:
            raise ValueError(norm_split_problem({"expert": True}))
        if start > 0:
            self.out_bias_share = 0.0
        for name, dim in (("w1", 2), ("w2", 1), ("w3", 2), ("b1", 1), ("b3", 1)):
            w = getattr(self, name)
            if w is not None:
                part = w.detach().narrow(dim, start, stop - start).clone()
                setattr(self, name, nn.Parameter(part, requires_grad=w.requires_grad))
        for adapter in self._adapters():
            adapter.keep_hidden(start, stop)

    @property
    def hidden(self) -> int:
        """The hidden width each expert holds (its share under tensor parallelism)."""
        return self.w1.shape[2]

    def _mlp(self, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, expert: int | None = None) -> Tensor:
        """The MLP on ``x [..., m, d]`` with weights batched like ``x``'s leading dims: every
        expert of the bank (``expert`` None, ``x [n, m, d]``) or expert ``expert``."""

        def bias(b: Tensor | None) -> Tensor | None:
            return None if b is None else b.unsqueeze(-2) if expert is None else b[expert]

        b1, b2, b3 = bias(self.b1), bias(self.b2), bias(self.b3)
        gate = x @ w1 if b1 is None else x @ w1 + b1
        up = None if w3 is None else x @ w3 if b3 is None else x @ w3 + b3
        out = activate(self.activation, gate, up) @ w2
        out = out if b2 is None else out + b2 * self.out_bias_share
        if self.norm is None or self.norm_eps is None:
            return out
        norm = self.norm.unsqueeze(-2) if expert is None else self.norm[expert]
        # normalised and weighed in fp32, then cast to the output's dtype (Ergo's expert norm)
        return (norm * normalised(out.float(), self.norm_eps)).to(out.dtype)

    def expert(self, i: int, x: Tensor) -> Tensor:
        """Run rows ``x [m, d]`` through the bank's expert ``i``."""
        w1, w2, w3 = self.weights()
        return self._mlp(x, w1[i], w2[i], None if w3 is None else w3[i], i)

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
        w1, w2, w3 = self.weights()
        out = [self._mlp(p, w1[i], w2[i], None if w3 is None else w3[i], i) for i, p in enumerate(pieces)]
        return torch.cat(out)

    def _grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        n, rows = self.count, x.shape[0]
        width = int(counts.max()) if n else 0
        expert = torch.repeat_interleave(torch.arange(n, device=x.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = expert * width + torch.arange(rows, device=x.device) - starts[expert]
        batch = x.new_zeros(n * width, x.shape[1]).index_copy(0, slot, x).view(n, width, x.shape[1])
        out = self._mlp(batch, *self.weights())
        return out.reshape(n * width, out.shape[-1]).index_select(0, slot)
