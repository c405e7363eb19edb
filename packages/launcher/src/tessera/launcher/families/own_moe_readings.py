"""How the parts of a user's mixture read as ``tessera.moe.MoE``'s weights.

`layout` finds a block's roles (router, experts, shared expert, choice-bias candidates,
top-k; ``tessera.launcher.families.own_moe`` says which layouts) as a `Layout`. A `Source`
says where one of the layer's weights comes from in the block: one tensor (the router's
``[E, d]`` weight; a bank of experts stored stacked, ``[E, d, h]`` or ``[E, h, d]``), or one
``nn.Linear`` weight per expert (stacked in expert order); ``transpose`` swaps the last two
dimensions (an ``nn.Linear`` weight is ``[out, in]``, the layer's ``[in, out]``). A `Reading`
is every source of one bank (``w1`` / ``w3`` / ``w2`` of SwiGLU, ``w1`` / ``w2`` of GELU).
`mlp_reading` reads one MLP of ``nn.Linear`` layers by running it beside each candidate
formula on random rows; `stacked_readings` lists every way stacked tensors can be the bank's
weights by their shapes (the block's own output decides among them); `mlp_outputs` computes
what a reading's MLPs compute.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.families.own_moe_routing import choice_biases
from tessera.moe import MoE

__all__ = [
    "Layout",
    "Reading",
    "Source",
    "bank_readings",
    "layout",
    "linear_children",
    "materialized",
    "may_hold_experts",
    "mlp_outputs",
    "mlp_reading",
    "mlp_sources",
    "stacked_readings",
]

Activation = Literal["swiglu", "gelu"]
TARGETS: dict[Activation, tuple[str, ...]] = {"swiglu": ("w1", "w3", "w2"), "gelu": ("w1", "w2")}
_RTOL = 1e-4
_TOP_K = ("top_k", "num_experts_per_tok", "topk", "k")


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


def mlp_outputs(reading: Reading, tensors: Mapping[str, Tensor], rows: Tensor) -> Tensor:
    """What the MLPs of ``reading`` compute on ``rows [T, d]``, in fp32, from the block's
    ``tensors``: ``[E, T, d]``, every expert on every row, for a bank; ``[T, d]`` for one MLP."""
    weights = [reading.sources[t].value(tensors).float() for t in TARGETS[reading.activation]]
    return _formula(rows.float(), reading.activation, weights)


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


@dataclass(frozen=True, slots=True)
class Layout:
    """A mixture found (`layout`): the router's weight, the experts (a ``ModuleList`` child, or the
    stacked tensors by name), the shared expert (a child), top-k and the choice-bias candidates
    (by name); ``d`` the model width."""

    router: str
    experts: str | None
    stacked: dict[str, tuple[int, ...]]
    shared: str | None
    top_k: int
    count: int
    d: int
    biases: tuple[str, ...] = ()


def _width(module: nn.Module, d: int) -> int | None:
    """The hidden width of an MLP ``d -> h -> d`` of ``nn.Linear`` layers (None: not one)."""
    linears = linear_children(module)
    if linears is None:
        return None
    ins = {lin.out_features for lin in linears.values() if lin.in_features == d}
    outs = {lin.in_features for lin in linears.values() if lin.out_features == d}
    return next(iter(ins & outs)) if len(ins & outs) == 1 else None


def _not_frozen_vector(p: Tensor) -> bool:
    """Whether a parameter counts among a router's: a frozen vector beside it is a choice bias."""
    return p.dim() != 1 or p.requires_grad


def _banks(module: nn.Module) -> list[tuple[str | None, dict[str, tuple[int, ...]], int]]:
    """Candidate expert banks of ``module``: a ``ModuleList`` child of two or more modules
    (name, {}, count), or two or three stacked ``[E, a, b]`` tensors held by the module itself
    or by one child (``None`` or the child's name, the tensors by name relative to the block)."""
    out: list[tuple[str | None, dict[str, tuple[int, ...]], int]] = []
    own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if p.dim() != 1}
    holders = [("", own)] + [
        (c, {f"{c}.{n}": tuple(p.shape) for n, p in child.named_parameters()})
        for c, child in module.named_children()
    ]
    for name, bank in module.named_children():
        if isinstance(bank, nn.ModuleList) and len(bank) >= 2:
            out.append((name, {}, len(bank)))
    for holder, shapes in holders:
        leading = {s[0] for s in shapes.values() if len(s) == 3}
        if 2 <= len(shapes) <= 3 and all(len(s) == 3 for s in shapes.values()) and len(leading) == 1:
            out.append((holder or None, shapes, leading.pop()))
    return out


def _router(module: nn.Module, count: int, skip: set[str]) -> tuple[str, int] | None:
    """The one child (not in ``skip``) whose only parameter (a frozen vector aside: a choice
    bias) is an ``[count, d]`` matrix: its parameter's name relative to the block and ``d``."""
    found = []
    for name, child in module.named_children():
        params = {n: p for n, p in child.named_parameters() if _not_frozen_vector(p)}
        if name in skip or len(params) != 1:
            continue
        ((pname, p),) = params.items()
        if p.dim() == 2 and p.shape[0] == count:
            found.append((f"{name}.{pname}", int(p.shape[1])))
    return found[0] if len(found) == 1 else None


def _refuse_extra(module: nn.Module, found: Layout, biases: list[str], trained: list[str]) -> None:
    """Refuse a block holding trained ``[E]`` vectors or own parameters besides its bank and
    choice-bias candidates (they would vanish from training and from exports)."""
    cls = type(module).__name__
    if trained:
        raise ValueError(
            f"{cls}: {trained} ({found.count},) train, but a vector beside a router only chooses experts "
            "(no gradient reaches it through a top-k): register it as a buffer or freeze it "
            "(requires_grad_(False)) so boost() can convert the block"
        )
    own = [n for n, _ in module.named_parameters(recurse=False) if n not in found.stacked and n not in biases]
    if own:
        raise ValueError(
            f"{cls} looks like a mixture of experts (router {found.router!r}, {found.count} experts) but "
            f"also holds parameters {own}: only a router, the experts, one shared expert and a choice bias "
            "convert"
        )


def layout(module: nn.Module) -> Layout | None:
    """``module``'s layout as a mixture of experts (``tessera.launcher.families.own_moe``), or
    None; ValueError naming what else it holds when it looks like one but cannot convert."""
    if isinstance(module, MoE):
        return None
    for experts, stacked, count in _banks(module):
        skip = {experts} if experts else {n.partition(".")[0] for n in stacked if "." in n}
        router = _router(module, count, skip)
        if router is None:
            continue
        weight, d = router
        if not stacked:
            bank: Any = getattr(module, experts or "")
            widths = {_width(e, d) for e in bank}
            if len(widths) != 1 or None in widths:
                continue
        taken = skip | {weight.partition(".")[0]}
        rest = [n for n, c in module.named_children() if n not in taken and any(True for _ in c.parameters())]
        shared = rest[0] if len(rest) == 1 and _width(getattr(module, rest[0]), d) is not None else None
        if rest and shared is None:
            raise ValueError(
                f"{type(module).__name__} looks like a mixture of experts (router {weight!r}, {count} "
                f"experts) but also holds {rest}: only a router, the experts and one shared expert convert"
            )
        top_k = next((getattr(module, a) for a in _TOP_K if isinstance(getattr(module, a, None), int)), None)
        if top_k is None:
            raise ValueError(
                f"{type(module).__name__}: a mixture of {count} experts without a top-k attribute (one "
                f"of {', '.join(_TOP_K)}): set one on the block so boost() can convert it"
            )
        biases, trained = choice_biases(module, weight.partition(".")[0], count)
        found = Layout(weight, experts if not stacked else None, stacked, shared, int(top_k), count, d)
        _refuse_extra(module, found, list(biases), trained)
        return dataclasses.replace(found, biases=tuple(biases))
    return None


def may_hold_experts(module: nn.Module) -> bool:
    """A cheap first look: a ``ModuleList`` child or a stacked ``[E, a, b]`` tensor."""
    return any(isinstance(c, nn.ModuleList) for c in module.children()) or any(
        p.dim() == 3 for p in module.parameters()
    )


def mlp_sources(path: str, module: nn.Module, d: int, per_expert: list[str] | None) -> Reading | None:
    """The reading of an MLP child at ``path`` (or of every expert ``per_expert`` paths, read
    as the first), its ``nn.Linear`` weights transposed into the layer's layout."""
    roles = mlp_reading(module, d)
    if roles is None:
        return None
    paths = per_expert if per_expert is not None else [path]
    sources = {t: Source(tuple(f"{p}.{c}.weight" for p in paths), True, True) for t, c in roles.items()}
    return Reading("swiglu" if len(roles) == 3 else "gelu", sources)


def bank_readings(block: nn.Module, found: Layout) -> list[Reading]:
    if found.experts is None:
        return list(stacked_readings(found.stacked, found.d))
    bank: Any = getattr(block, found.experts)
    paths = [f"{found.experts}.{e}" for e in range(len(bank))]
    reading = mlp_sources(paths[0], bank[0], found.d, paths)
    return [] if reading is None else [reading]
