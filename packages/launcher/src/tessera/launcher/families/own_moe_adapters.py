"""PEFT's LoRA adapters on a user's own mixture, carried into its converted ``tessera.moe.MoE``.

PEFT wraps each targeted ``nn.Linear`` of the block (an expert's projection, the shared
expert's, the router) in a LoRA layer holding ``lora_A [r, in]`` and ``lora_B [out, r]``. The
block is read without them (`hf_moe_adapters.peeled`), and `carry_own` gives the converted
layer the same adapters, placed by what the conversion read each projection as:

- the projection ``t`` (``w1`` gate, ``w3`` up, ``w2`` down) of every expert -> one
  ``ExpertAdapter`` under key ``t`` whose ``down`` stacks the experts' ``lora_A`` and whose
  ``up[t]`` stacks their ``lora_B`` (every expert must carry the adapter, of one rank and
  scale);
- the shared expert's projection ``t`` -> a one-expert adapter on the shared bank;
- the router's ``nn.Linear`` -> a ``RouterAdapter``.

The converted adapters export under the user's names again (each expert's ``lora_A`` /
``lora_B`` a slice of the stacked tensors), the base projections under PEFT's
``base_layer.weight``; the layer's ``peft_sources`` (see `hf_moe_adapters`) lists each
adapter's PEFT modules, one per expert, for PEFT's adapter files. Refused, naming the place:
an adapter on stacked expert tensors or anywhere else in the block, on some experts only,
with dropout, DoRA or a bias.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.families.hf_moe_adapters import PEFT_SOURCES, Wrapped, adapter_names, copied, factors
from tessera.moe import ExpertAdapter, MoE, RouterAdapter

__all__ = ["carry_own"]

Place = tuple[str, str, int | None]  # (bank or "router", weight, expert index)


def _places(prefix: str, exported: Mapping[str, tuple[ExportPart, ...]]) -> dict[str, Place]:
    """Each projection module the conversion read (relative to the block) -> where it went."""
    out: dict[str, Place] = {}
    for trained, parts in exported.items():
        bank, _, weight = trained[len(prefix) :].partition(".")
        for part in parts:
            module = part.name[len(prefix) :].removesuffix(".weight")
            out[module] = (bank, weight, part.index)
    return out


def carry_own(
    layer: MoE, wrapped: list[Wrapped], exported: dict[str, tuple[ExportPart, ...]], prefix: str
) -> dict[str, tuple[ExportPart, ...]]:
    """Give ``layer`` the block's adapters (module docstring); returns ``exported`` (the
    conversion's parts under the block's names, ``prefix`` the block's) with the adapters'
    own parts added and each wrapped projection's base named ``base_layer.weight``."""
    places = _places(prefix, exported)
    groups: dict[tuple[str, str, str], dict[int | None, tuple[Wrapped, torch.Tensor, torch.Tensor, float]]]
    groups = defaultdict(dict)
    where = prefix.removesuffix(".")
    for item in wrapped:
        place = f"{where}.{item.path}"
        found = places.get(item.path)
        if found is None or item.param != "weight" or not isinstance(item.wrapper.base_layer, nn.Linear):
            raise ValueError(
                f"{place}: an adapter there is not carried into tessera.moe.MoE (adapters on the experts' "
                "and the shared expert's nn.Linear projections and on the router are); leave it out of "
                "the adapters' targets"
            )
        bank, weight, index = found
        for name in adapter_names(item.wrapper, place):
            a, b, scaling = factors(item.wrapper, name, place)
            groups[(bank, weight, name)][index] = (item, a, b, scaling)
    out = {k: tuple(_based(p, places, wrapped, prefix) for p in parts) for k, parts in exported.items()}
    sources: dict[str, tuple[str, ...]] = {}
    for (bank, weight, name), by_expert in groups.items():
        module, parts = _attach(layer, bank, weight, name, by_expert, where)
        sources[module] = tuple(item.path for item, *_ in parts)
        out.update(_adapter_parts(prefix, module, weight, name, [item.path for item, *_ in parts], bank))
    setattr(layer, PEFT_SOURCES, sources)
    return out


def _based(part: ExportPart, places: Mapping[str, Place], wrapped: list[Wrapped], prefix: str) -> ExportPart:
    module = part.name[len(prefix) :].removesuffix(".weight")
    if any(item.path == module for item in wrapped):
        return ExportPart(f"{prefix}{module}.base_layer.weight", part.index, part.transpose)
    return part


def _attach(
    layer: MoE,
    bank: str,
    weight: str,
    name: str,
    by_expert: Mapping[int | None, tuple[Wrapped, torch.Tensor, torch.Tensor, float]],
    where: str,
) -> tuple[str, list[tuple[Wrapped, torch.Tensor, torch.Tensor, float]]]:
    like = layer.router.weight
    if bank == "router":
        ((item, a, b, scaling),) = by_expert.values()
        router = RouterAdapter(copied(a, like), copied(b, like), scaling=scaling)
        router.requires_grad_(a.requires_grad or b.requires_grad)
        layer.router.adapters[name] = router
        return f"router.adapters.{name}", [(item, a, b, scaling)]
    target = layer.experts if bank == "experts" else layer.shared
    assert target is not None
    count = target.count
    order = [by_expert.get(e) for e in range(count)]
    missing = [e for e, got in enumerate(order) if got is None]
    parts = [got for got in order if got is not None]
    shapes = {(tuple(a.shape), tuple(b.shape), s) for _, a, b, s in parts}
    if missing or len(shapes) != 1:
        raise ValueError(
            f"{where}.{bank}: adapter {name!r} on {weight} must be on every expert with one rank and "
            f"scale; experts {missing} have none" + ("" if len(shapes) == 1 else f", shapes {sorted(shapes)}")
        )
    down = torch.stack([copied(a, like) for _, a, _, _ in parts])
    up = torch.stack([copied(b, like) for _, _, b, _ in parts])
    adapter = ExpertAdapter(down, {weight: up}, site="out" if weight == "w2" else "in", scaling=parts[0][3])
    adapter.requires_grad_(any(a.requires_grad or b.requires_grad for _, a, b, _ in parts))
    target.add_adapter(name, adapter, key=weight)
    return f"{bank}.adapters.{name}.{weight}", parts


def _adapter_parts(
    prefix: str, module: str, weight: str, name: str, paths: list[str], bank: str
) -> dict[str, tuple[ExportPart, ...]]:
    """The adapter's tensors under the user's (PEFT) names: each expert's a slice."""
    if bank == "router":
        (path,) = paths
        return {
            f"{prefix}{module}.down": (ExportPart(f"{prefix}{path}.lora_A.{name}.weight"),),
            f"{prefix}{module}.up": (ExportPart(f"{prefix}{path}.lora_B.{name}.weight"),),
        }
    return {
        f"{prefix}{module}.down": tuple(
            ExportPart(f"{prefix}{p}.lora_A.{name}.weight", index=e) for e, p in enumerate(paths)
        ),
        f"{prefix}{module}.up.{weight}": tuple(
            ExportPart(f"{prefix}{p}.lora_B.{name}.weight", index=e) for e, p in enumerate(paths)
        ),
    }
