"""A user's own mixture-of-experts blocks, found by their layout and converted to
``tessera.moe.MoE``, under their own names again in exports.

A block is found by its roles, whatever it and its parts are called: a **router** (a child
whose one trained parameter is an ``[E, d]`` matrix: an ``nn.Linear(d, E, bias=False)`` or a
module holding one), **experts**, either an ``nn.ModuleList`` of ``E`` alike MLPs made of
bias-free ``nn.Linear`` layers only (SwiGLU with three, GELU with two) or ``E`` experts stored
stacked (two or three ``[E, a, b]`` tensors, held by the block itself or by one child),
optionally a **shared expert** (one more such MLP, always on) and a **choice bias** (an
``[E]`` buffer or frozen parameter of the block or of its router, DeepSeek-V3's
auxiliary-loss-free balancing: `own_moe_routing.choice_biases`). ``top_k`` is read from the
block (``top_k``, ``num_experts_per_tok``, ``topk``, ``k``). What the names cannot say is
measured, not assumed: an MLP's gate, up and down projections by running it beside each
candidate (`own_moe_readings.mlp_reading`); the rest (for stacked experts, every assignment
and orientation their shapes allow; the router's scores, choice bias, group limit, scale
and renormalisation: `own_moe_routing`) by running the block on random tokens and keeping the
reading that gives its output (fp32 round-off: rtol 1e-4 of the output's scale); the
converted ``MoE`` is then run beside the block on the same tokens once more. A block no
reading reproduces is refused, naming what was tried. The choice bias keeps the block's name
(`NamedMoE.keep_bias`): the converted model's state dict, and so its exports, hold it where
the user's model does. So does every other buffer of the block (a load counter, say), with the
value it had before the conversion: the converted layer does not compute it, and one the
block's forward changes stays at that value from then on (logged). A model built without
storage (``deferred_parameters``) is probed on a copy with random values (a reading is a
matter of function, not of values) and its layers stay on meta.

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
    Layout,
    Reading,
    bank_readings,
    layout,
    materialized,
    may_hold_experts,
    mlp_outputs,
    mlp_sources,
)
from tessera.launcher.families.own_moe_routing import RTOL, Prober, RoutingReading, read_routing
from tessera.moe import MoE

__all__ = ["Conversion", "NamedMoE", "convert_own_moe", "find_own_moe"]

log = logging.getLogger(__name__)

_PROBE_SHAPE = (2, 16)  # the probe's tokens: batch x sequence


class NamedMoE(MoE):
    """An `MoE` that also answers to the converted block's names for its losses (``aliases``:
    the block's attribute -> ``aux_loss`` or ``z_loss``) and holds its router's choice bias
    under the block's name for it (`keep_bias`)."""

    def __init__(self, *args: Any, aliases: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aliases = dict(aliases)
        self.bias_name: str | None = None

    def __getattr__(self, name: str) -> Any:
        aliases = self.__dict__.get("aliases", {})
        if name in aliases:
            return getattr(self, aliases[name])
        return super().__getattr__(name)

    def keep_buffer(self, name: str, value: Tensor, *, persistent: bool = True, what: str = "buffer") -> None:
        """Hold ``value`` as the buffer ``name`` (relative to the layer, made of plain modules
        where the layer has none), so that the state dict, and so exports, hold it where the
        user's block did. ValueError when the layer has another attribute by that name."""
        *path, leaf = name.split(".")
        owner: nn.Module = self
        for part in path:
            if part not in owner._modules:
                if hasattr(owner, part):
                    raise ValueError(
                        f"the converted layer cannot hold the {what} {name}: it has its own {part}"
                    )
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        if hasattr(owner, leaf) and leaf not in owner._buffers:
            raise ValueError(f"the converted layer cannot hold the {what} {name}: it has its own {leaf}")
        owner.register_buffer(leaf, value, persistent=persistent)

    def keep_bias(self, name: str, value: Tensor, *, persistent: bool = True) -> None:
        """Hold ``value``, the router's choice bias (``router.score_bias``), as the buffer
        ``name`` (`keep_buffer`), which the state dict holds in place of ``router.score_bias``
        (persistent as the user's was); the router reads it from there at every call."""
        self.keep_buffer(name, value, persistent=persistent, what="choice bias")
        owner, _, leaf = name.rpartition(".")
        if self.get_submodule(owner) is not self.router or leaf != "score_bias":
            self.router._non_persistent_buffers_set.add("score_bias")
        self.bias_name = name
        self._link_bias()

    def _link_bias(self) -> None:
        if self.bias_name is not None:
            owner, _, leaf = self.bias_name.rpartition(".")
            self.router._buffers["score_bias"] = self.get_submodule(owner)._buffers[leaf]

    def _apply(self, fn: Any, recurse: bool = True) -> NamedMoE:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self._link_bias()  # both names were converted apart: the router reads the block's again
        return self

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> Tensor:
        self._link_bias()  # a load with assign=True, or a user's assignment, replaces the named one
        return super().forward(x, input_ids)


@dataclass
class Conversion:
    """What `convert_own_moe` did: ``exported`` maps each new parameter's trained name to its
    parts under the user's names; ``groups`` each new parameter's optimizer group;
    ``blocks`` the converted blocks' names."""

    exported: dict[str, tuple[ExportPart, ...]] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)


def find_own_moe(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block of ``model`` laid out as a mixture of experts (module docstring)."""
    found = []
    for name, module in model.named_modules():
        if may_hold_experts(module):
            with peeled(module):
                if layout(module) is not None:
                    found.append((name, module))
    return found


def _layer(
    block: nn.Module, found: Layout, bank: Reading, shared: Reading | None, routing: RoutingReading
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
        renormalize=routing.renormalize,
        routing=routing.spec,
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


def _floats(module: nn.Module) -> list[float]:
    return [v for v in vars(module).values() if isinstance(v, float)]


def _converted(
    name: str, block: nn.Module, found: Layout
) -> tuple[NamedMoE, dict[str, tuple[ExportPart, ...]]]:
    """The `NamedMoE` reproducing ``block`` (module docstring) and its parameters' parts under
    the block's names."""
    meta = any(p.is_meta for p in block.parameters())
    buffers = {n: b.detach().clone() for n, b in block.named_buffers()}  # before the probe runs it
    probe = materialized(block) if meta else block
    tensors = {n: p.detach() for n, p in probe.named_parameters()}
    prober = Prober(name, probe, tensors[found.router], found.biases)
    router = probe.get_submodule(found.router.rpartition(".")[0])
    scales = _floats(probe) + _floats(router)
    x = torch.randn(*_PROBE_SHAPE, found.d, generator=torch.Generator().manual_seed(0)).to(prober.weight)
    probes = prober.run(x)
    shared = None
    if found.shared is not None:
        shared = mlp_sources(found.shared, getattr(probe, found.shared), found.d, None)
        if shared is None:
            raise ValueError(
                f"{name}.{found.shared}: no reading of the shared expert as SwiGLU or GELU gives its output"
            )
    tried = []
    for bank in bank_readings(probe, found):

        def outputs(rows: Tensor, bank: Reading = bank) -> tuple[Tensor, Tensor | None]:
            common = None if shared is None else mlp_outputs(shared, tensors, rows)
            return mlp_outputs(bank, tensors, rows), common

        matches = read_routing(prober, found.top_k, outputs, probes, scales)
        if matches:
            routing = matches[0]
            break
        tried.append(f"[{bank.describe()}]")
    else:
        bias = (
            f"without a choice bias or with one of {list(found.biases)}" if found.biases else "no choice bias"
        )
        raise ValueError(
            f"{name} ({type(block).__name__}): no reading of its experts and router as tessera.moe.MoE gives "
            f"its output; tried experts {' '.join(tried) or 'none'}, each with softmax and sigmoid top-"
            f"{found.top_k} scores, renormalised or not, {bias}, every group limit of {found.count} experts "
            "and a fitted scale, every token kept"
        )
    if routing.bias in prober.moved:
        raise ValueError(
            f"{name} ({type(block).__name__}): its forward changes its choice bias {routing.bias}, which the "
            "converted layer's router would not: move it between steps instead (MoE.stats.routed counts "
            "each expert's assignments)"
        )
    if meta and routing.bias in dict(block.named_parameters()):
        raise ValueError(
            f"{name}: its choice bias {routing.bias} is a parameter, which a model built without storage "
            "(deferred_parameters) leaves without values: register it as a buffer (buffers stay real)"
        )
    layer = _layer(probe, found, bank, shared, routing)
    score = routing.spec.score
    if routing.bias is not None:  # the values the probe gave the block's bias
        layer.keep_bias(routing.bias, prober.values[score][routing.bias].clone())
    with torch.no_grad():
        got = layer(x)
    want = probes[score].want
    if float((got.reshape(want.shape).float() - want).abs().max()) > RTOL * (float(want.abs().max()) or 1.0):
        raise ValueError(
            f"{name}: the converted layer ({routing.describe()}) does not give the block's output"
        )
    aliases = _aliases(name, probes[score].recorded, layer)
    if meta:  # the same reading, with the block's own (meta) parameters
        layer = _layer(block, found, bank, shared, routing)
    if routing.bias is not None:  # the block's own values, under its name, as it held them
        owner, _, leaf = routing.bias.rpartition(".")
        holder = block.get_submodule(owner)
        value = holder._buffers[leaf] if leaf in holder._buffers else holder._parameters[leaf]
        assert value is not None
        persistent = leaf not in holder._non_persistent_buffers_set
        layer.keep_bias(routing.bias, value.detach(), persistent=persistent)
    _keep_buffers(name, block, layer, buffers, skip=routing.bias, moved=prober.moved)
    layer.aliases = aliases
    for key, value in vars(block).items():  # the block's plain settings
        if (
            isinstance(value, int | float | bool | str)
            and not hasattr(layer, key)
            and not key.startswith("_")
        ):
            setattr(layer, key, value)
    log.info("%s (%s): %s, %s experts", name, type(block).__name__, routing.describe(), bank.activation)
    return layer, _exported(f"{name}.", found, bank, shared)


def _keep_buffers(
    name: str,
    block: nn.Module,
    layer: NamedMoE,
    before: Mapping[str, Tensor],
    *,
    skip: str | None,
    moved: set[str],
) -> None:
    """Every other buffer of ``block`` (a load counter, a running statistic) kept on ``layer``
    under its name with the value it had before the conversion probed the block, persistent
    as it was, so that exports and strict loads find it. The converted layer does not compute
    it: one that the block's forward changed on the probe (``moved``: the ``[E]`` choice-bias
    candidates the prober put back; or any other found changed) stays at that value from now
    on, which is logged."""
    for key, value in before.items():
        if key == skip:
            continue
        owner, _, leaf = key.rpartition(".")
        holder = block.get_submodule(owner)
        layer.keep_buffer(key, value, persistent=leaf not in holder._non_persistent_buffers_set)
        after = holder._buffers[leaf]
        changed = after is not None and not after.is_meta and not torch.equal(after, value)
        if key in moved or changed:
            log.warning(
                "%s.%s changes in %s's forward; the converted layer keeps it at its value and does not "
                "change it (MoE.stats.routed counts each expert's assignments)",
                name, key, type(block).__name__,
            )  # fmt: skip
        holder._buffers[leaf] = value.clone()  # the user's block as it was, should they keep it


def _aliases(name: str, recorded: Mapping[str, Tensor], layer: MoE) -> dict[str, str]:
    out = {}
    for attr, value in recorded.items():
        for ours in ("aux_loss", "z_loss"):
            theirs = getattr(layer, ours)
            if abs(float(value.detach()) - float(theirs.detach())) <= RTOL * max(abs(float(theirs)), 1e-12):
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
    prefix: str, found: Layout, bank: Reading, shared: Reading | None
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
    for name, block in [(n, m) for n, m in model.named_modules() if n and may_hold_experts(m)]:
        prefix = f"{name}."
        with peeled(block) as wrapped:  # PEFT's adapters: read without, then carried
            found = layout(block)
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
