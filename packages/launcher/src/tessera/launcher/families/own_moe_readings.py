"""How the parts of a user's mixture read as ``tessera.moe.MoE``'s weights.

A `Source` says where one of the layer's weights comes from in the block: one tensor (the
router's ``[E, d]`` weight; a bank of experts stored stacked, ``[E, d, h]`` or ``[E, h, d]``),
or one ``nn.Linear`` weight per expert (stacked in expert order); ``transpose`` swaps the
last two dimensions (an ``nn.Linear`` weight is ``[out, in]``, the layer's ``[in, out]``).
A `Reading` is every source of one bank (``w1`` / ``w3`` / ``w2`` of SwiGLU, ``w1`` / ``w2`` of
GELU). `mlp_reading` reads one MLP of ``nn.Linear`` layers by running it beside each
candidate formula on random rows; `stacked_readings` lists every way stacked tensors can be
the bank's weights by their shapes (the block's own output decides among them).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart

__all__ = ["Reading", "Source", "linear_children", "materialized", "mlp_reading", "stacked_readings"]

Activation = Literal["swiglu", "gelu"]
TARGETS: dict[Activation, tuple[str, ...]] = {"swiglu": ("w1", "w3", "w2"), "gelu": ("w1", "w2")}
_RTOL = 1e-4


@dataclass(frozen=True, slots=True)
class Source:
    """One weight of the layer from the block's tensors ``names`` (relative to the block):
    ``per_expert``: one 2-D tensor per expert, stacked; else one tensor as it is; then the last
    two dimensions swapped when ``transpose``."""

    names: tuple[str, ...]
    per_expert: bool
    transpose: bool

    def value(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """The weight in the layer's layout."""
        parts = [tensors[n] for n in self.names]
        out = torch.stack(parts) if self.per_expert else parts[0]
        return out.transpose(-2, -1) if self.transpose else out

    def parts(self, prefix: str) -> tuple[ExportPart, ...]:
        """The weight's tensors under the block's names (``prefix``: the block's)."""
        if self.per_expert:
            return tuple(
                ExportPart(prefix + n, index=i, transpose=self.transpose) for i, n in enumerate(self.names)
            )
        return (ExportPart(prefix + self.names[0], transpose=self.transpose),)


@dataclass(frozen=True, slots=True)
class Reading:
    """A bank's weights (``w1``, ``w3``, ``w2`` or ``w1``, ``w2``) and its activation."""

    activation: Activation
    sources: dict[str, Source]

    def describe(self) -> str:
        """A short account, for a refusal's list of what was tried."""
        return ", ".join(
            f"{t}={'/'.join(s.names[:1])}{'.T' if s.transpose else ''}" for t, s in self.sources.items()
        )


def linear_children(module: nn.Module) -> dict[str, nn.Linear] | None:
    """The bias-free ``nn.Linear`` children of ``module`` when that is all it holds (two or
    three of them), else None."""
    if any(True for _ in module.named_parameters(recurse=False)):
        return None
    linears: dict[str, nn.Linear] = {}
    holding = set()
    for n, c in module.named_children():
        if isinstance(c, nn.Linear) and c.bias is None:
            linears[n] = c
        if any(True for _ in c.parameters()):
            holding.add(n)
    return linears if len(linears) in (2, 3) and holding == set(linears) else None


def materialized(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose meta parameters hold random values: what a probe runs when
    the model was built without storage (``deferred_parameters``). A reading is a matter of
    the module's function, not of its values."""
    copied = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(1)
    for sub in copied.modules():
        for pname, p in sub._parameters.items():
            if p is not None and p.is_meta:
                value = torch.randn(p.shape, generator=gen).to(p.dtype) / max(p.shape[-1], 1) ** 0.5
                sub._parameters[pname] = nn.Parameter(value, requires_grad=p.requires_grad)
    return copied


def _formula(x: Tensor, activation: Activation, w: list[Tensor]) -> Tensor:
    """The MLP on rows ``x`` with weights ``[in, out]`` in ``TARGETS`` order."""
    if activation == "gelu":
        return F.gelu(x @ w[0]) @ w[1]
    return (F.silu(x @ w[0]) * (x @ w[1])) @ w[2]


def mlp_reading(module: nn.Module, d: int) -> dict[str, str] | None:
    """Which ``nn.Linear`` child of the MLP ``module`` (``d -> h -> d``) is each weight, as
    ``{"w1": child, ...}`` (SwiGLU: gate ``w1``, up ``w3``, down ``w2``; GELU: ``w1``, ``w2``),
    found by running it beside each candidate on random rows (None when none gives its output).
    Its parameters may be on the meta device: a copy with random values is run then."""
    linears = linear_children(module)
    if linears is None:
        return None
    if any(lin.weight.is_meta for lin in linears.values()):
        module = materialized(module)
        linears = {n: getattr(module, n) for n in linears}
    x = torch.randn(16, d, generator=torch.Generator().manual_seed(3)).to(next(iter(linears.values())).weight)
    with torch.no_grad():
        want = module(x)
        if not isinstance(want, Tensor) or want.shape != x.shape:
            return None
        scale = float(want.abs().max()) or 1.0
        activation: Activation = "swiglu" if len(linears) == 3 else "gelu"
        for order in itertools.permutations(linears):
            lins = [linears[n] for n in order]
            if lins[0].in_features != d or lins[-1].out_features != d:
                continue
            try:
                got = _formula(x, activation, [lin.weight.t() for lin in lins])
            except RuntimeError:  # shapes that do not chain
                continue
            if float((got - want).abs().max()) <= _RTOL * scale:
                return dict(zip(TARGETS[activation], order, strict=True))
    return None


def stacked_readings(tensors: Mapping[str, tuple[int, ...]], d: int) -> Iterator[Reading]:
    """Every way tensors ``[E, a, b]`` (by name, relative to the block) can be a bank's
    weights by their shapes: SwiGLU from three, GELU from two, each as stored or transposed."""
    activation: Activation = "swiglu" if len(tensors) == 3 else "gelu"
    targets = TARGETS[activation]
    for order in itertools.permutations(tensors):
        for flips in itertools.product((False, True), repeat=len(order)):
            shapes = [
                tensors[n][1:] if not f else tensors[n][:0:-1] for n, f in zip(order, flips, strict=True)
            ]
            hidden = shapes[0][1]
            want = [(d, hidden)] * (len(order) - 1) + [(hidden, d)]
            if [tuple(s) for s in shapes] == want:
                yield Reading(
                    activation,
                    {t: Source((n,), False, f) for t, n, f in zip(targets, order, flips, strict=True)},
                )
