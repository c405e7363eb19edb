"""A user's own mixture-of-experts blocks, found by their layout and converted to
``tessera.moe.MoE``, under their own names again in exports.

A block is found by its roles, whatever it and its parts are called: a **router** (a child
whose one parameter is an ``[E, d]`` matrix: an ``nn.Linear(d, E, bias=False)`` or a module
holding one), **experts**, either an ``nn.ModuleList`` of ``E`` alike MLPs made of bias-free
``nn.Linear`` layers only (SwiGLU with three, GELU with two) or ``E`` experts stored stacked
(two or three ``[E, a, b]`` tensors, held by the block itself or by one child) and,
optionally, a **shared expert** (one more such MLP, always on). ``top_k`` is read from the
block (``top_k``, ``num_experts_per_tok``, ``topk``, ``k``). What the names cannot say is
measured, not assumed: an MLP's gate, up and down projections by running it beside each
candidate (`own_moe_readings.mlp_reading`); the rest (for stacked experts, every assignment
and orientation their shapes allow; whether the router scores by softmax or by sigmoid;
whether the top-k weights are renormalised) by building each reading as an ``MoE`` with
copies of the block's weights and running it beside the block on
the same random tokens: the one that gives the block's output (fp32 round-off: rtol 1e-4 of
the output's scale) is kept, and a block none reproduces is refused, naming what was tried.
A model built without storage (``deferred_parameters``) is probed on a copy with random
values (a reading is a matter of function, not of values) and its layers stay on meta.

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
one group, trainable or frozen alike). PEFT's LoRA adapters on the block's projections are
carried into the converted layer (`own_moe_adapters`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.families.hf_moe_adapters import peeled
from tessera.launcher.families.own_moe_adapters import carry_own
from tessera.launcher.families.own_moe_readings import (
    Reading,
    Source,
    linear_children,
    materialized,
    mlp_reading,
    stacked_readings,
)
from tessera.moe import MoE, RouterSpec

__all__ = ["Conversion", "NamedMoE", "convert_own_moe", "find_own_moe"]

log = logging.getLogger(__name__)

_TOP_K = ("top_k", "num_experts_per_tok", "topk", "k")
_PROBE_SHAPE = (2, 16)  # the probe's tokens: batch x sequence
_RTOL = 1e-4
_SCORES = ("softmax", "sigmoid")  # the router scores a probe tries (tessera.moe.RouterSpec)


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


@dataclass
class Conversion:
    """What `convert_own_moe` did: ``exported`` maps each new parameter's trained name to its
    parts under the user's names; ``groups`` each new parameter's optimizer group;
    ``blocks`` the converted blocks' names."""

    exported: dict[str, tuple[ExportPart, ...]] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Block:
    """One block found: the router's weight, the experts (a ``ModuleList`` child, or the
    stacked tensors by name), the shared expert (a child) and top-k; ``d`` the model width."""

    router: str
    experts: str | None
    stacked: dict[str, tuple[int, ...]]
    shared: str | None
    top_k: int
    count: int
    d: int


def _width(module: nn.Module, d: int) -> int | None:
    """The hidden width of an MLP ``d -> h -> d`` of ``nn.Linear`` layers (None: not one)."""
    linears = linear_children(module)
    if linears is None:
        return None
    ins = {lin.out_features for lin in linears.values() if lin.in_features == d}
    outs = {lin.in_features for lin in linears.values() if lin.out_features == d}
    return next(iter(ins & outs)) if len(ins & outs) == 1 else None


def _banks(module: nn.Module) -> list[tuple[str | None, dict[str, tuple[int, ...]], int]]:
    """Candidate expert banks of ``module``: a ``ModuleList`` child of two or more modules
    (name, {}, count), or two or three stacked ``[E, a, b]`` tensors held by the module itself
    or by one child (``None`` or the child's name, the tensors by name relative to the block)."""
    out: list[tuple[str | None, dict[str, tuple[int, ...]], int]] = []
    own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
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
    """The one child (not in ``skip``) whose only parameter is an ``[count, d]`` matrix: its
    parameter's name relative to the block and ``d``."""
    found = []
    for name, child in module.named_children():
        params = dict(child.named_parameters())
        if name in skip or len(params) != 1:
            continue
        ((pname, p),) = params.items()
        if p.dim() == 2 and p.shape[0] == count:
            found.append((f"{name}.{pname}", int(p.shape[1])))
    return found[0] if len(found) == 1 else None


def _block(module: nn.Module) -> _Block | None:
    """Whether ``module`` is laid out as a mixture (module docstring)."""
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
        return _Block(weight, experts if not stacked else None, stacked, shared, int(top_k), count, d)
    return None


def _may_hold_experts(module: nn.Module) -> bool:
    """A cheap first look: a ``ModuleList`` child or a stacked ``[E, a, b]`` tensor."""
    return any(isinstance(c, nn.ModuleList) for c in module.children()) or any(
        p.dim() == 3 for p in module.parameters()
    )


def find_own_moe(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block of ``model`` laid out as a mixture of experts (module docstring)."""
    found = []
    for name, module in model.named_modules():
        if _may_hold_experts(module):
            with peeled(module):
                if _block(module) is not None:
                    found.append((name, module))
    return found


def _mlp_sources(path: str, module: nn.Module, d: int, per_expert: list[str] | None) -> Reading | None:
    """The reading of an MLP child at ``path`` (or of every expert ``per_expert`` paths, read
    as the first), its ``nn.Linear`` weights transposed into the layer's layout."""
    roles = mlp_reading(module, d)
    if roles is None:
        return None
    paths = per_expert if per_expert is not None else [path]
    sources = {t: Source(tuple(f"{p}.{c}.weight" for p in paths), True, True) for t, c in roles.items()}
    return Reading("swiglu" if len(roles) == 3 else "gelu", sources)


def _bank_readings(block: nn.Module, found: _Block) -> list[Reading]:
    if found.experts is None:
        return list(stacked_readings(found.stacked, found.d))
    bank: Any = getattr(block, found.experts)
    paths = [f"{found.experts}.{e}" for e in range(len(bank))]
    reading = _mlp_sources(paths[0], bank[0], found.d, paths)
    return [] if reading is None else [reading]


def _layer(
    block: nn.Module, found: _Block, bank: Reading, shared: Reading | None, renormalize: bool, score: str
) -> NamedMoE:
    tensors = {n: p.detach() for n, p in block.named_parameters()}
    router = tensors[found.router]
    w1 = bank.sources["w1"].value(tensors)
    if shared is not None and shared.activation != bank.activation:
        raise ValueError("the shared expert's activation differs from the experts'")
    layer = NamedMoE(
        found.d,
        int(w1.shape[-1]),
        found.count,
        found.top_k,
        activation=bank.activation,
        renormalize=renormalize,
        routing=RouterSpec(score=score),  # type: ignore[arg-type]  # "softmax" or "sigmoid"
        shared_hidden=None if shared is None else int(shared.sources["w1"].value(tensors).shape[-1]),
        seed=0,
        aliases={},
    ).to(device=router.device, dtype=router.dtype)
    params = dict(block.named_parameters())
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for prefix, reading in (("experts", bank), ("shared", shared)):
            if reading is None:
                continue
            for target, source in reading.sources.items():
                layer.get_parameter(f"{prefix}.{target}").copy_(source.value(tensors))
                trains = {params[n].requires_grad for n in source.names}
                if len(trains) > 1:
                    raise ValueError(f"{type(block).__name__}: {source.names} are partly frozen")
                layer.get_parameter(f"{prefix}.{target}").requires_grad_(trains.pop())
    layer.router.requires_grad_(params[found.router].requires_grad)
    return layer


def _scalars(module: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in vars(module).items() if isinstance(v, Tensor) and v.dim() == 0}


def _converted(
    name: str, block: nn.Module, found: _Block
) -> tuple[NamedMoE, dict[str, tuple[ExportPart, ...]]]:
    """The `NamedMoE` reproducing ``block`` (module docstring) and its parameters' parts under
    the block's names."""
    meta = any(p.is_meta for p in block.parameters())
    probe = materialized(block) if meta else block
    router = dict(probe.named_parameters())[found.router]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*_PROBE_SHAPE, found.d, generator=gen).to(router.device, router.dtype)
    before = _scalars(probe)
    with torch.no_grad():
        want = probe(x)
    if not isinstance(want, Tensor) or want.shape != x.shape:
        raise ValueError(
            f"{name} ({type(block).__name__}) returns {type(want).__name__}, not one tensor shaped like its "
            "input: a converted tessera.moe.MoE could not stand in for it"
        )
    recorded = {k: v for k, v in _scalars(probe).items() if before.get(k) is not v}
    shared = None
    if found.shared is not None:
        shared = _mlp_sources(found.shared, getattr(probe, found.shared), found.d, None)
        if shared is None:
            raise ValueError(
                f"{name}.{found.shared}: no reading of the shared expert as SwiGLU or GELU gives its output"
            )
    readings = _bank_readings(probe, found)
    tried = []
    for bank, score, renormalize in itertools.product(readings, _SCORES, (True, False)):
        layer = _layer(probe, found, bank, shared, renormalize, score)
        with torch.no_grad():
            got = layer(x)
        scale = float(want.abs().max()) or 1.0
        if float((got - want).abs().max()) <= _RTOL * scale:
            aliases = _aliases(name, recorded, layer)
            if meta:  # the same reading, with the block's own (meta) parameters
                layer = _layer(block, found, bank, shared, renormalize, score)
            layer.aliases = aliases
            for key, value in vars(block).items():  # the block's plain settings
                if (
                    isinstance(value, int | float | bool | str)
                    and not hasattr(layer, key)
                    and not key.startswith("_")
                ):
                    setattr(layer, key, value)
            return layer, _exported(f"{name}.", found, bank, shared)
        tried.append(f"[{bank.describe()}] {score} renormalize={renormalize}")
    raise ValueError(
        f"{name} ({type(block).__name__}): no reading of its experts as tessera.moe.MoE "
        f"(softmax or sigmoid top-{found.top_k}, every token kept) gives its output; tried "
        f"{'; '.join(tried) or 'none'}"
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
    prefix: str, found: _Block, bank: Reading, shared: Reading | None
) -> dict[str, tuple[ExportPart, ...]]:
    """The converted layer's parameters under the block's own names."""
    out: dict[str, tuple[ExportPart, ...]] = {f"{prefix}router.weight": (ExportPart(prefix + found.router),)}
    for group, reading in (("experts", bank), ("shared", shared)):
        if reading is not None:
            out.update({f"{prefix}{group}.{t}": s.parts(prefix) for t, s in reading.sources.items()})
    return out


def convert_own_moe(model: nn.Module, groups: Mapping[str, int] | None = None) -> Conversion:
    """Replace every block of ``model`` laid out as a mixture (module docstring) by the
    `NamedMoE` that reproduces it, in place, under the block's name. ``groups``: the optimizer
    group of every trainable parameter by its current name (``boost``'s); the result gives the
    new parameters theirs. Refuses (ValueError naming the block) one it cannot reproduce, before
    any block is replaced."""
    conversion = Conversion()
    layers = []
    for name, block in [(n, m) for n, m in model.named_modules() if n and _may_hold_experts(m)]:
        prefix = f"{name}."
        with peeled(block) as wrapped:  # PEFT's adapters: read without, then carried
            found = _block(block)
            if found is None:
                continue
            layer, exported = _converted(name, block, found)
            if wrapped:
                exported = carry_own(layer, wrapped, exported, prefix)
        if groups is not None:
            held = {groups[f"{prefix}{n}"] for n, p in block.named_parameters() if f"{prefix}{n}" in groups}
            if len(held) > 1:
                raise ValueError(f"{name}: its parameters are in {len(held)} optimizer groups; one is needed")
            if held:
                group = held.pop()
                trained = (n for n, p in layer.named_parameters() if p.requires_grad)
                conversion.groups.update({f"{prefix}{n}": group for n in trained})
        conversion.exported.update(exported)
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
