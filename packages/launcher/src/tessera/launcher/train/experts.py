"""Expert parallelism in ``boost()``: every ``tessera.moe.MoE`` layer split over the ep group.

With ``parallel.ep`` > 1 the data-parallel ranks form expert-parallel groups of ``ep``
consecutive ranks (`tessera.comm.Topology`). ``check_experts`` finds the model's MoE layers
by type (whatever the model calls them) and refuses, before anything changes, a model
without one, a layer whose experts ``ep`` does not divide (naming the layer, its experts
and ep) and, at any ep, a layer already built expert-parallel. ``shard_moe`` then keeps on each rank
its ``experts / ep`` experts of every layer (`tessera.moe.shard_experts`: tokens travel to
their experts by all-to-all over the ep group) and returns what ZeRO shards over the
expert-data-parallel group (``expert_sharding``, asked once tensor parallelism has replaced
what it splits): every expert bank's parameters (`tessera.moe.expert_parameters`;
the routers and shared experts are dense, reduced over the whole data-parallel group).

An expert-parallel engine holds each layer's experts split over the ep ranks under the
serial parameter names; ``expert_slices`` says which experts of each bank a rank holds, so
that what assembles the serial model (the portable state of a checkpoint, consolidation,
export) gathers the banks over the ep group and what loads one (a resume under another
layout, an import, deferred initialization) keeps each rank's slice.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from tessera.comm import Mesh, group_size
from tessera.moe import MoE, expert_parameters, shard_experts

__all__ = ["check_experts", "expert_sharding", "expert_slices", "moe_layers", "shard_moe"]

log = logging.getLogger(__name__)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every ``tessera.moe.MoE`` module of ``model`` with its name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_experts(model: nn.Module, ep: int) -> None:
    """Refuse (ValueError naming the values) what ``shard_moe`` cannot split over ``ep`` ranks,
    and (at any ep) a layer already built expert-parallel, whose expert gradients boost()
    would average over the wrong ranks."""
    layers = moe_layers(model)
    built = [name for name, m in layers if m.ep_group is not None and group_size(m.ep_group) > 1]
    if built:
        raise ValueError(
            f"MoE layers {built} are already expert-parallel (built with ep_group=): build them serial "
            f"and set parallel.ep (now {ep}) to let boost() shard them"
        )
    if ep == 1:
        return
    if not layers:
        raise ValueError(
            f"parallel.ep={ep} but {type(model).__name__} has no tessera.moe.MoE layer: nothing to split"
        )
    uneven = [f"{name} ({m.num_experts} experts)" for name, m in layers if m.num_experts % ep]
    if uneven:
        raise ValueError(f"parallel.ep={ep} must divide the experts of every MoE layer: {', '.join(uneven)}")


def shard_moe(model: nn.Module, mesh: Mesh) -> None:
    """Split every MoE layer's experts over this rank's ep group (checked by ``check_experts``)."""
    ep = mesh.topology.ep
    if ep == 1:
        return
    group = mesh.group("ep")
    layers = moe_layers(model)
    for _, layer in layers:
        shard_experts(layer, group)
    log.info(
        "expert parallelism: %d MoE layers split over ep=%d (this rank: ep %d of %d, edp %d of %d)",
        len(layers), ep, mesh.coordinate("ep"), ep, mesh.coordinate("edp"), mesh.size("edp"),
    )  # fmt: skip


def expert_sharding(module: nn.Module, mesh: Mesh) -> dict[nn.Parameter, dist.ProcessGroup]:
    """Every expert parameter ``module`` holds now (after tensor parallelism replaced some), mapped
    to the expert-data-parallel group ZeRO shards it over (empty when ep = 1)."""
    if mesh.topology.ep == 1:
        return {}
    edp = mesh.group("edp")
    return {param: edp for param in expert_parameters(module)}


def expert_slices(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The name of every expert bank parameter of ``model``'s expert-parallel MoE layers and the
    experts ``(start, stop)`` of the serial bank it holds (none before ``shard_moe``)."""
    out: dict[str, tuple[int, int]] = {}
    for name, layer in moe_layers(model):
        if layer.ep_group is None:
            continue
        span = (layer.first_expert, layer.first_expert + layer.experts.count)
        for pname, _ in layer.experts.named_parameters():
            out[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = span
    return out
