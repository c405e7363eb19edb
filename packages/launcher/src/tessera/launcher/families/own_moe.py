"""A user's own mixture-of-experts blocks, found by their layout and converted to
``tessera.moe.MoE``, under their own names again in exports.

A block is found by its roles, whatever it and its parts are called: a **router** (a
bias-free ``nn.Linear(d, E)``), **experts** (an ``nn.ModuleList`` of ``E`` alike MLPs, each
made of bias-free ``nn.Linear`` only: SwiGLU with three, GELU with two) and, optionally, a
**shared expert** (one more such MLP, always on). ``top_k`` is read from the block
(``top_k``, ``num_experts_per_tok``, ``topk``, ``k``). What the names cannot say (which
projection is the gate and which the up projection, whether the top-k weights are
renormalised) is measured, not assumed: every reading is built as an ``MoE`` with copies
of the block's weights and run beside the block on the same random tokens, and the one
that gives the block's output (fp32 round-off: rtol 1e-4 of the output's scale) is kept; a
block no reading reproduces is refused, naming what was tried.

The block's own loss attributes keep working: a scalar tensor the block's forward sets (a
load-balancing loss recorded as ``self.balance_loss``, say) that equals the ``MoE``'s
``aux_loss`` or ``z_loss`` on the probe becomes an alias of it on the converted layer (so
a model method or a loss function summing them reads the converted layers' losses, with
their gradients); one that equals neither is refused, naming its value and ours, since it
would silently stop changing. Plain settings of the block (ints, floats, bools, strings)
are kept on the converted layer as they were.

`convert_own_moe` converts every such block in place and returns a `Conversion`: the
trained names of the converted layers' parameters mapped to the user's names
(``ExportPart``: per expert, ``w1[e].T`` is ``experts.<e>.<gate>.weight``), which
``boost()`` records so that ``export`` and ``consolidate`` write the user's names, and the
optimizer group of every new parameter (each stacked bank must come from parameters of
one group, trainable or frozen alike).
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.moe import MoE

__all__ = ["Conversion", "NamedMoE", "convert_own_moe", "find_own_moe"]

log = logging.getLogger(__name__)

_TOP_K = ("top_k", "num_experts_per_tok", "topk", "k")
_PROBE_SHAPE = (2, 16)  # the probe's tokens: batch x sequence
_RTOL = 1e-4


class NamedMoE(MoE):
    """An `MoE` that also answers to the converted block's names for its losses (``aliases``:
    the block's attribute -> ``aux_loss`` or ``z_loss``)."""

    def __init__(self, *args: Any, aliases: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aliases = dict(aliases)

    def __getattr__(self, name: str) -> Any:
        aliases = self.__dict__.get("aliases", {})
        if name in aliases:
            return getattr(self, aliases[name])
        return super().__getattr__(name)


@dataclass(frozen=True, slots=True)
class _Block:
    """One block found: its router, experts and shared expert (child names) and top-k."""

    router: str
    experts: str
    shared: str | None
    top_k: int


@dataclass
class Conversion:
    """What `convert_own_moe` did: ``exported`` maps each new parameter's trained name to its
    parts under the user's names; ``groups`` each new parameter's optimizer group;
    ``blocks`` the converted blocks' names."""

    exported: dict[str, tuple[ExportPart, ...]] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)


def _mlp(module: nn.Module) -> dict[str, nn.Linear] | None:
    """The bias-free ``nn.Linear`` children of ``module`` when that is all it holds (two or
    three of them), else None."""
    if any(True for _ in module.named_parameters(recurse=False)):
        return None
    children = dict(module.named_children())
    linears: dict[str, nn.Linear] = {}
    for n, c in children.items():
        if isinstance(c, nn.Linear) and c.bias is None:
            linears[n] = c
    holding = {n for n, c in children.items() if any(True for _ in c.parameters())}
    return linears if len(linears) in (2, 3) and holding == set(linears) else None


def _width(module: nn.Module, d: int) -> int | None:
    """The hidden width of an MLP ``d -> h -> d`` (None when it is not one)."""
    linears = _mlp(module)
    if linears is None:
        return None
    ins = {lin.out_features for lin in linears.values() if lin.in_features == d}
    outs = {lin.in_features for lin in linears.values() if lin.out_features == d}
    return next(iter(ins & outs)) if len(ins & outs) == 1 else None


def _block(module: nn.Module) -> _Block | None:
    """Whether ``module`` is laid out as a mixture (module docstring)."""
    if isinstance(module, MoE):
        return None
    children = dict(module.named_children())
    for name, bank in children.items():
        if not isinstance(bank, nn.ModuleList) or len(bank) < 2:
            continue
        routers = [
            n
            for n, c in children.items()
            if isinstance(c, nn.Linear) and c.bias is None and c.out_features == len(bank)
        ]
        if len(routers) != 1:
            continue
        router = children[routers[0]]
        assert isinstance(router, nn.Linear)
        d = router.in_features
        widths = {_width(e, d) for e in bank}
        if len(widths) != 1 or None in widths:
            continue
        rest = [
            n
            for n, c in children.items()
            if n not in (name, routers[0]) and any(True for _ in c.parameters())
        ]
        shared = rest[0] if len(rest) == 1 and _width(children[rest[0]], d) is not None else None
        if rest and shared is None:
            raise ValueError(
                f"{type(module).__name__} looks like a mixture of experts (router {routers[0]!r}, experts "
                f"{name!r}) but also holds {rest}: only a router, the experts and one shared expert convert"
            )
        top_k = next((getattr(module, a) for a in _TOP_K if isinstance(getattr(module, a, None), int)), None)
        if top_k is None:
            raise ValueError(
                f"{type(module).__name__}: a mixture of {len(bank)} experts without a top-k attribute (one "
                f"of {', '.join(_TOP_K)}): set one on the block so boost() can convert it"
            )
        return _Block(routers[0], name, shared, int(top_k))
    return None


def find_own_moe(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block of ``model`` laid out as a mixture of experts (module docstring)."""
    return [(n, m) for n, m in model.named_modules() if _block(m) is not None]


def _readings(linears: Mapping[str, nn.Linear], d: int) -> Iterator[tuple[str, ...]]:
    """The ways to read an expert's projections as (gate, up, down) or (fc, down)."""
    for order in itertools.permutations(linears):
        first, last = linears[order[0]], linears[order[-1]]
        if first.in_features == d and last.out_features == d:
            yield order


def _layer(block: nn.Module, found: _Block, reading: tuple[str, ...], renormalize: bool) -> NamedMoE:
    bank: Any = getattr(block, found.experts)
    router: nn.Linear = getattr(block, found.router)
    experts = [dict(e.named_children()) for e in bank]
    d, hidden = router.in_features, experts[0][reading[0]].out_features
    shared: Any = getattr(block, found.shared) if found.shared is not None else None
    layer = NamedMoE(
        d,
        hidden,
        len(experts),
        found.top_k,
        activation="swiglu" if len(reading) == 3 else "gelu",
        renormalize=renormalize,
        shared_hidden=None if shared is None else getattr(shared, reading[0]).out_features,
        seed=0,
        aliases={},
    ).to(device=router.weight.device, dtype=router.weight.dtype)
    targets = ("w1", "w3", "w2") if len(reading) == 3 else ("w1", "w2")
    with torch.no_grad():
        layer.router.weight.copy_(router.weight)
        for e, expert in enumerate(experts):
            for target, source in zip(targets, reading, strict=True):
                getattr(layer.experts, target)[e].copy_(expert[source].weight.t())
        if shared is not None:
            assert layer.shared is not None
            for target, source in zip(targets, reading, strict=True):
                getattr(layer.shared, target)[0].copy_(getattr(shared, source).weight.t())
    for name, bank_or_shared in (("experts", bank), ("shared", shared)):  # frozen stays frozen
        if bank_or_shared is not None:
            trains = {p.requires_grad for p in bank_or_shared.parameters()}
            if len(trains) > 1:
                raise ValueError(f"{type(block).__name__}.{name}: some parameters are frozen and some not")
            getattr(layer, name).requires_grad_(trains.pop())
    layer.router.requires_grad_(router.weight.requires_grad)
    return layer


def _scalars(module: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in vars(module).items() if isinstance(v, Tensor) and v.dim() == 0}


def _materialized(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose meta parameters hold random values: what the probe runs when
    the model was built without storage (``deferred_parameters``). The readings are a matter of
    the block's function, not of its values."""
    copied = copy.deepcopy(block)
    gen = torch.Generator().manual_seed(1)
    for module in copied.modules():
        for pname, p in module._parameters.items():
            if p is not None and p.is_meta:
                value = torch.randn(p.shape, generator=gen).to(p.dtype) / max(p.shape[-1], 1) ** 0.5
                module._parameters[pname] = nn.Parameter(value, requires_grad=p.requires_grad)
    return copied


def _converted(name: str, block: nn.Module, found: _Block) -> tuple[NamedMoE, tuple[str, ...]]:
    """The `NamedMoE` reproducing ``block`` (module docstring) and the reading it took."""
    meta = any(p.is_meta for p in block.parameters())
    probe = _materialized(block) if meta else block
    router: nn.Linear = getattr(probe, found.router)
    d = router.in_features
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*_PROBE_SHAPE, d, generator=gen).to(router.weight.device, router.weight.dtype)
    before = _scalars(probe)
    with torch.no_grad():
        want = probe(x)
    if not isinstance(want, Tensor) or want.shape != x.shape:
        raise ValueError(
            f"{name} ({type(block).__name__}) returns {type(want).__name__}, not one tensor shaped like its "
            "input: a converted tessera.moe.MoE could not stand in for it"
        )
    recorded = {k: v for k, v in _scalars(probe).items() if before.get(k) is not v}
    expert0: Any = getattr(block, found.experts)[0]
    tried = []
    for reading, renormalize in itertools.product(_readings(_mlp(expert0) or {}, d), (True, False)):
        layer = _layer(probe, found, reading, renormalize)
        with torch.no_grad():
            got = layer(x)
        scale = float(want.abs().max()) or 1.0
        if float((got - want).abs().max()) <= _RTOL * scale:
            aliases = _aliases(name, recorded, layer)
            if meta:  # the same reading, with the block's own (meta) parameters
                layer = _layer(block, found, reading, renormalize)
            layer.aliases = aliases
            for key, value in vars(block).items():  # the block's plain settings
                if (
                    isinstance(value, int | float | bool | str)
                    and not hasattr(layer, key)
                    and not key.startswith("_")
                ):
                    setattr(layer, key, value)
            return layer, reading
        tried.append(f"{'/'.join(reading)} renormalize={renormalize}")
    raise ValueError(
        f"{name} ({type(block).__name__}): no reading of its experts as tessera.moe.MoE "
        f"(softmax top-{found.top_k}, every token kept) gives its output; tried {'; '.join(tried)}"
    )


def _aliases(name: str, recorded: Mapping[str, Tensor], layer: MoE) -> dict[str, str]:
    out = {}
    for attr, value in recorded.items():
        for ours in ("aux_loss", "z_loss"):
            theirs = getattr(layer, ours)
            if abs(float(value.detach()) - float(theirs.detach())) <= _RTOL * max(abs(float(theirs)), 1e-12):
                out[attr] = ours
                break
        else:
            raise ValueError(
                f"{name}.{attr} ({float(value):.6g}) is neither the load-balancing loss "
                f"({float(layer.aux_loss):.6g}) nor the z-loss ({float(layer.z_loss):.6g}) that "
                "tessera.moe.MoE records: after conversion it would stop changing; read the layer's "
                "aux_loss instead"
            )
    return out


def _exported(
    prefix: str, block: nn.Module, found: _Block, reading: tuple[str, ...]
) -> dict[str, tuple[ExportPart, ...]]:
    """The converted layer's parameters under the block's own names."""
    targets = ("w1", "w3", "w2") if len(reading) == 3 else ("w1", "w2")
    bank: Any = getattr(block, found.experts)
    out: dict[str, tuple[ExportPart, ...]] = {
        f"{prefix}router.weight": (ExportPart(f"{prefix}{found.router}.weight"),)
    }
    for target, source in zip(targets, reading, strict=True):
        out[f"{prefix}experts.{target}"] = tuple(
            ExportPart(f"{prefix}{found.experts}.{e}.{source}.weight", index=e, transpose=True)
            for e in range(len(bank))
        )
        if found.shared is not None:
            out[f"{prefix}shared.{target}"] = (
                ExportPart(f"{prefix}{found.shared}.{source}.weight", index=0, transpose=True),
            )
    return out


def convert_own_moe(model: nn.Module, groups: Mapping[str, int] | None = None) -> Conversion:
    """Replace every block of ``model`` laid out as a mixture (module docstring) by the
    `NamedMoE` that reproduces it, in place, under the block's name. ``groups``: the optimizer
    group of every trainable parameter by its current name (``boost``'s); the result gives the
    new parameters theirs. Refuses (ValueError naming the block) one it cannot reproduce, before
    any block is replaced."""
    conversion = Conversion()
    layers = []
    for name, block in [(n, m) for n, m in model.named_modules() if n]:
        found = _block(block)
        if found is None:
            continue
        layer, reading = _converted(name, block, found)
        prefix = f"{name}."
        if groups is not None:
            held = {groups[f"{prefix}{n}"] for n, p in block.named_parameters() if f"{prefix}{n}" in groups}
            if len(held) > 1:
                raise ValueError(f"{name}: its parameters are in {len(held)} optimizer groups; one is needed")
            if held:
                group = held.pop()
                trained = (n for n, p in layer.named_parameters() if p.requires_grad)
                conversion.groups.update({f"{prefix}{n}": group for n in trained})
        conversion.exported.update(_exported(prefix, block, found, reading))
        conversion.blocks.append(name)
        layers.append((name, layer))
    for name, layer in layers:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    if layers:
        log.info(
            "converted %d mixture-of-experts blocks to tessera.moe.MoE: %s", len(layers), conversion.blocks
        )
    return conversion
