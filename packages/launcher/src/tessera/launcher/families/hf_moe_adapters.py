"""PEFT's LoRA adapters on an HF sparse MoE block, carried into its ``tessera.moe.MoE``.

PEFT adapts a stacked expert weight with a parameter wrapper (``target_parameters``, or
``all-linear`` on recent blocks): ``experts`` becomes a chain of wrappers, one per weight
(``parameter_name`` ``gate_up_proj`` or ``down_proj``), each holding ``lora_A [E*r, in]``
(expert-major rows) and ``lora_B [out, E*r]`` (expert-minor columns), so that expert e's
weight ``[out, in]`` gains ``scaling * B_e @ A_e``. The router's weight is wrapped the same
way (one expert), and the shared expert's projections are PEFT ``Linear`` layers. They are
read by their layout (PEFT is not imported): `peeled` takes the wrappers off a block while it
is read, and `carry` gives the converted layer the same adapters (`tessera.moe.adapters`):

- ``experts.gate_up_proj`` -> an ``in`` adapter on the bank: ``down = A_e`` and the up
  projections of ``w1`` (gate rows of ``B_e``) and ``w3`` (up rows);
- ``experts.down_proj`` -> an ``out`` adapter: ``down = A_e``, ``up[w2] = B_e``;
- the router's weight -> a ``RouterAdapter``;
- the shared expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` -> one-expert adapters on
  the shared bank (``w1`` / ``w3`` / ``w2``) under their own keys.

Frozen and trained flags are kept, tensors copied. The layer's attribute ``peft_sources``
maps each adapter module (relative to the layer) to the PEFT modules it came from (relative
to the block, with PEFT's ``base_layer`` nesting), and `to_peft` gives their PEFT tensors back,
so that an adapter file keeps PEFT's keys. Refused, naming the place: an adapter
anywhere else in the block, dropout, DoRA or a bias on an adapter, an adapter that is not
active, and a stacked weight whose adapter is laid out ``(experts, in, out)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tessera.moe import ExpertAdapter, MoE, RouterAdapter
from tessera.moe.adapters import Site

__all__ = [
    "PEFT_SOURCES",
    "Wrapped",
    "adapter_names",
    "carry",
    "copied",
    "factors",
    "is_wrapper",
    "peel",
    "peeled",
    "to_peft",
]

PEFT_SOURCES = "peft_sources"  # a converted layer's attribute: adapter module -> PEFT's modules

_SHARED: dict[str, tuple[str, Site]] = {
    "gate_proj": ("w1", "in"),
    "up_proj": ("w3", "in"),
    "down_proj": ("w2", "out"),
}


def is_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer (a ``base_layer`` and ``lora_A`` adapters)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def peel(module: nn.Module) -> nn.Module:
    """``module`` without its PEFT wrappers (itself when it has none)."""
    while is_wrapper(module):
        module = module.base_layer  # type: ignore[assignment]
    return module


@dataclass(frozen=True, slots=True)
class Wrapped:
    """One adapted tensor of a block: ``path`` (the module, relative to the block) and
    ``param``, and the wrapper that adapts it."""

    path: str
    param: str
    wrapper: nn.Module


@contextmanager
def peeled(block: nn.Module) -> Iterator[list[Wrapped]]:
    """Take every PEFT wrapper off ``block``'s submodules while the context lasts (put back
    after, also on an error); yields the adapted tensors."""
    found: list[tuple[nn.Module, str, nn.Module]] = []
    wrapped: list[Wrapped] = []
    for path, module in list(block.named_modules()):
        if not path or not is_wrapper(module) or any(path.startswith(w.path + ".") for w in wrapped):
            continue
        parent_path, _, child = path.rpartition(".")
        parent = block.get_submodule(parent_path)
        layer: nn.Module = module
        while is_wrapper(layer):
            wrapped.append(Wrapped(path, str(getattr(layer, "parameter_name", "weight")), layer))
            layer = layer.base_layer  # type: ignore[assignment]
        found.append((parent, child, module))
        setattr(parent, child, layer)
    try:
        yield wrapped
    finally:
        for parent, child, module in found:
            setattr(parent, child, module)


def carry(layer: MoE, wrapped: list[Wrapped], *, router_weight: str, shared: str | None, where: str) -> None:
    """Give ``layer`` (converted from the block) the block's adapters (module docstring);
    ``router_weight`` / ``shared``: where the block keeps its router's weight and its shared
    expert."""
    router, _, weight = router_weight.rpartition(".")
    targets = {("experts", "gate_up_proj"), ("experts", "down_proj"), (router, weight)}
    if shared is not None:
        targets |= {(f"{shared}.{p}", "weight") for p in ("gate_proj", "up_proj", "down_proj")}
    sources: dict[str, tuple[str, ...]] = {}
    for depth, item in _nested(wrapped):
        place = f"{where}.{item.path}.{item.param}"
        if (item.path, item.param) not in targets:
            raise ValueError(
                f"{place}: an adapter there is not carried into tessera.moe.MoE (adapters on the experts, "
                "the router and the shared expert's projections are); leave it out of the adapters' targets"
            )
        for name in adapter_names(item.wrapper, place):
            a, b, scaling = factors(item.wrapper, name, place)
            module = _attach(layer, item, name, a, b, scaling, place)
            sources[module] = (item.path + ".base_layer" * depth,)
    setattr(layer, PEFT_SOURCES, sources)


def _nested(wrapped: list[Wrapped]) -> list[tuple[int, Wrapped]]:
    """Each wrapper with its depth under its module's outermost wrapper (PEFT's key for it has
    that many ``base_layer`` components)."""
    seen: dict[str, int] = {}
    out = []
    for item in wrapped:
        out.append((seen.get(item.path, 0), item))
        seen[item.path] = seen.get(item.path, 0) + 1
    return out


def adapter_names(wrapper: Any, place: str) -> list[str]:
    """The adapters of PEFT layer ``wrapper``; ValueError naming ``place`` if one is not active."""
    names = list(wrapper.lora_A.keys())
    active = set(getattr(wrapper, "active_adapters", names))
    idle = [n for n in names if n not in active]
    if idle:
        raise ValueError(
            f"{place}: adapters {idle} are not active; delete them or activate them before converting"
        )
    return names


def factors(wrapper: Any, name: str, place: str) -> tuple[Tensor, Tensor, float]:
    """Adapter ``name``'s ``lora_A`` and ``lora_B`` weights and scale; ValueError naming
    ``place`` for dropout, DoRA or a bias."""
    drop = wrapper.lora_dropout[name] if name in getattr(wrapper, "lora_dropout", {}) else None
    dora = getattr(wrapper, "use_dora", {})
    if isinstance(drop, nn.Dropout) and drop.p > 0:
        raise ValueError(f"{place}: adapter {name!r} has dropout {drop.p}; converted adapters take none")
    if (isinstance(dora, dict) and dora.get(name)) or wrapper.lora_B[name].bias is not None:
        raise ValueError(f"{place}: adapter {name!r} is DoRA or has a bias; only plain LoRA is converted")
    a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    return a, b, float(wrapper.scaling[name])


def copied(t: Tensor, like: Tensor) -> Tensor:
    """A detached contiguous copy of ``t`` on ``like``'s device, in its dtype."""
    return t.detach().to(device=like.device, dtype=like.dtype).contiguous().clone()


def _attach(layer: MoE, item: Wrapped, name: str, a: Tensor, b: Tensor, scaling: float, place: str) -> str:
    """Give ``layer`` adapter ``name`` of ``item``; returns its module's path in the layer."""
    trained = a.requires_grad or b.requires_grad
    like = layer.experts.w1
    if item.path == "experts":
        n, h = layer.experts.count, layer.experts.hidden
        param = getattr(peel(item.wrapper), item.param)
        if not getattr(item.wrapper, "_did_swap_in_out_features", a.shape[-1] == param.shape[2]):
            raise ValueError(
                f"{place}: its adapter {name!r} is laid out (experts, in, out); tessera reads "
                "(experts, out, in)"
            )
        down = copied(a, like).reshape(n, -1, a.shape[-1])
        up = copied(b, like).reshape(b.shape[0], -1, n).permute(2, 0, 1).contiguous()
        if item.param == "gate_up_proj":
            adapter = ExpertAdapter(down, {"w1": up[:, :h], "w3": up[:, h:]}, site="in", scaling=scaling)
        else:
            adapter = ExpertAdapter(down, {"w2": up}, site="out", scaling=scaling)
        adapter.requires_grad_(trained)
        layer.experts.add_adapter(name, adapter)
        return f"experts.adapters.{name}.{adapter.site}"
    if item.path.endswith(("gate_proj", "up_proj", "down_proj")):  # the shared expert's
        assert layer.shared is not None
        part = item.path.rpartition(".")[2]
        weight, site = _SHARED[part]
        shared = ExpertAdapter(
            copied(a, like).unsqueeze(0), {weight: copied(b, like).unsqueeze(0)}, site=site, scaling=scaling
        )
        shared.requires_grad_(trained)
        layer.shared.add_adapter(name, shared, key=part)
        return f"shared.adapters.{name}.{part}"
    router = RouterAdapter(copied(a, like), copied(b, like), scaling=scaling)
    router.requires_grad_(trained)
    layer.router.adapters[name] = router
    return f"router.adapters.{name}"


def to_peft(kind: str, down: Tensor, ups: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """PEFT's ``(lora_A, lora_B)`` weights of a converted adapter, one pair per PEFT module it
    came from (the inverse of `carry`): ``kind`` ``"experts"`` (``down [E, r, in]``, ``ups`` by
    weight ``[E, out, r]``, gate before up; PEFT's one stacked pair), ``"per_expert"`` (a user's
    mixture: a pair per expert), ``"shared"`` (one expert) or ``"router"`` (``down [r, d]``,
    ``ups {"up": [E, r]}``)."""
    if kind == "router":
        return [(down, ups["up"])]
    stacked = torch.cat([ups[w] for w in ("w1", "w3", "w2") if w in ups], dim=1)  # [E, out, r]
    if kind in ("shared", "per_expert"):
        return [(down[e], stacked[e]) for e in range(down.shape[0])]
    return [(down.reshape(-1, down.shape[-1]), stacked.permute(1, 2, 0).reshape(stacked.shape[1], -1))]
