"""Where a boosted rank's parameters sit in the user's serial model, and what a boosted
model offers to the code that saves and gathers it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from tessera.comm import Mesh
from tessera.launcher.checkpoint.adapted import Adapters
from tessera.launcher.checkpoint.exported import ExportPart, found_parts, parts_of
from tessera.launcher.checkpoint.tensorfile import Renames
from tessera.tensor_parallel import ShardSpec
from tessera.zero import ZeroOptimizer

__all__ = ["Boosted", "Placement", "load_buffers", "local_part", "persistent_buffers"]


@dataclass(frozen=True)
class Placement:
    """The serial name and shape of every local parameter, how tensor parallelism split it,
    and the pipeline's stage owners.

    ``shard_specs`` maps the serial name of each parameter split over tp to its
    ``ShardSpec`` (what ``parallelize`` recorded); every other parameter is whole on each tp
    rank. ``replicated`` maps each parameter held identically by all tp ranks (a norm not
    split by tensor parallelism) to tp, so that norms count it once. ``experts`` maps the
    serial name of every expert bank split over the ep group to the experts this rank holds,
    ``(start, stop)`` along its first dimension (empty without expert parallelism); its tp
    split, if any, is of that slice. ``aliases`` maps every further name of a tied parameter
    in the serial model's state dict (HF's ``lm_head.weight`` tied to the token embedding)
    to the name it trains under, so that an export holds every key a strict load expects.
    ``exported`` maps a parameter trained under a name and shape of boost()'s own (a user's or
    a Hugging Face mixture of experts converted to ``tessera.moe.MoE``) to the tensors it
    exports as, under the user's names (`tessera.launcher.checkpoint.exported`), and a
    persistent buffer so renamed (a converted router's score-correction bias) to its name.
    ``buffers`` maps each persistent buffer this rank's module holds whole (by its name in
    that module) to its serial name: exports and imports carry them beside the parameters (a
    router's score-correction bias is state a strict load expects). ``adapters``: the model's low-rank
    adapters and their PEFT configurations (`tessera.launcher.checkpoint.adapted`), for PEFT's
    adapter files and a merged export. ``renames``: how a foreign checkpoint's tensor names read as
    the model's (a Hugging Face family's loading renames), for ``import_weights``; None: as
    they are.
    """

    names: dict[nn.Parameter, str]  # serial name of each local parameter
    full_shapes: dict[str, tuple[int, ...]]  # serial shape of every parameter
    replicated: dict[nn.Parameter, int]  # parameters identical on tp ranks -> tp
    shard_specs: dict[str, ShardSpec] = field(default_factory=dict)  # serial name -> tp split
    stage_to_rank: tuple[int, ...] = field(default=())  # pipeline: rank of every stage
    experts: dict[str, tuple[int, int]] = field(default_factory=dict)  # serial name -> ep slice
    aliases: dict[str, str] = field(default_factory=dict)  # tied: second name -> parameter's name
    exported: dict[str, tuple[ExportPart, ...]] = field(default_factory=dict)  # name -> the user's names
    buffers: dict[str, str] = field(default_factory=dict)  # local persistent buffer -> serial name
    adapters: Adapters = field(default_factory=Adapters)  # low-rank adapters (PEFT's LoRA)
    renames: Renames | None = None  # a foreign checkpoint's names -> the model's

    def part(self, full: Tensor, name: str, tp_rank: int, tp: int, shape: Sequence[int]) -> Tensor:
        """This rank's part of the serial tensor ``name`` (`local_part` under this placement)."""
        return local_part(full, name, self.shard_specs, self.experts, tp_rank, tp, shape)


def persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """Every persistent buffer of ``model`` (one its state dict holds) by name."""
    out = {}
    for owner, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{owner}.{name}" if owner else name] = buf
    return out


def load_buffers(engine: Boosted, weights: Mapping[str, Tensor], path: Path) -> None:
    """Copy into this rank's persistent buffers (``Placement.buffers``: a router's bias) those
    that ``weights`` holds by serial name (or by the name ``Placement.exported`` gives it, or
    that name's ``legacy`` one), as they are (or from the part's ``view``); local; ValueError
    naming a misshapen one (read from ``path``)."""
    held = dict(engine.module.named_buffers())
    with torch.no_grad():
        for local, serial in engine.placement.buffers.items():
            parts = found_parts(parts_of(serial, engine.placement.exported)[:1], weights.__contains__)
            if parts:
                value = weights[parts[0].name]
                if parts[0].view is not None and tuple(value.shape) == parts[0].view:  # ERNIE's [1, E]
                    value = value.reshape(held[local].shape)
                if tuple(value.shape) != tuple(held[local].shape):
                    raise ValueError(
                        f"{path}: buffer {parts[0].name} has shape {tuple(value.shape)}, the model's "
                        f"{tuple(held[local].shape)}"
                    )
                held[local].copy_(value)


def local_part(
    full: Tensor,
    name: str,
    shard_specs: Mapping[str, ShardSpec],
    experts: Mapping[str, tuple[int, int]],
    tp_rank: int,
    tp: int,
    shape: Sequence[int],
) -> Tensor:
    """The part of serial tensor ``name`` (a parameter's value, or its optimizer state) that
    tensor-parallel rank ``tp_rank`` of ``tp`` holds: the experts ``experts[name]`` of an expert
    bank, then that slice's shard as ``shard_specs[name]`` says (a name in neither is whole).
    ValueError, naming the shapes, when the part is not ``shape`` (the local parameter's)."""
    span, spec = experts.get(name), shard_specs.get(name)
    mine = full if span is None else full[span[0] : span[1]]
    part = mine if spec is None else spec.shard(mine, tp_rank, tp)
    if tuple(part.shape) != tuple(shape):
        held = "" if span is None else f"experts {span[0]}..{span[1] - 1}, "
        raise ValueError(
            f"{name}: the serial {tuple(full.shape)} gives {tuple(part.shape)} on {held}tp rank {tp_rank} "
            f"of {tp}; the parameter is {tuple(shape)}"
        )
    return part


class Boosted(Protocol):
    """What checkpoints and consolidation read from a boosted model (an ``Engine`` is one)."""

    @property
    def mesh(self) -> Mesh: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def zero(self) -> ZeroOptimizer: ...
    @property
    def placement(self) -> Placement: ...
