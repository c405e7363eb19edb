"""Gather a boosted model's parameters back into the serial model's full state dict.

Tensor-parallel shards are all-gathered over tp and joined as the parameter's ``ShardSpec``
says (recorded by ``parallelize``, kept in the ``Placement``; nothing is inferred from
shapes); an expert bank split over the ep group is then all-gathered over it along the
experts (``Placement.experts``); ZeRO-3 shards are gathered by ``ZeroOptimizer.gathered``;
pipeline stages meet in files: the (dp 0, tp 0) rank of every stage writes its part and
global rank 0 merges them. Every file is written atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor

from tessera.comm import Group, all_gather
from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.comm.safefile import SafeFile
from tessera.launcher.placement import Boosted
from tessera.tensor_parallel import ShardSpec

__all__ = [
    "consolidate",
    "export_sharded",
    "full_tensor",
    "local_full_gradients",
    "local_full_parameters",
    "unshard",
]


def unshard(
    local: Tensor, spec: ShardSpec | None, full_shape: tuple[int, ...], tp: int, group: Group
) -> Tensor:
    """The full tensor of this rank's ``local`` shard split as ``spec`` says (None: whole)
    over ``tp`` ranks of ``group``; collective over the group when split."""
    full = local
    if spec is not None:
        gathered = all_gather(local.detach().contiguous(), group, spec.local_dim)
        full = spec.unshard(gathered.chunk(tp, spec.local_dim))
    if tuple(full.shape) != full_shape:
        raise ValueError(
            f"unsharding {tuple(local.shape)} (split {spec}) over tp={tp} gave {tuple(full.shape)}, "
            f"not {full_shape}"
        )
    return full


def full_tensor(engine: Boosted, name: str, local: Tensor) -> Tensor:
    """The full tensor of serial parameter ``name`` (or of its optimizer state) from this
    rank's ``local`` part: its tp shards joined as its ``ShardSpec`` says, then, for an expert
    bank split over the ep group, the ep ranks' experts concatenated in order. Collective over
    tp and ep where ``name`` is split over them."""
    placement, mesh = engine.placement, engine.mesh
    shape = tuple(placement.full_shapes[name])
    span = placement.experts.get(name)
    if span is not None:
        shape = (span[1] - span[0], *shape[1:])
    full = unshard(local, placement.shard_specs.get(name), shape, mesh.size("tp"), mesh.group("tp"))
    if span is not None:
        full = all_gather(full.contiguous(), mesh.group("ep"), 0)
        if tuple(full.shape) != tuple(placement.full_shapes[name]):
            raise ValueError(
                f"{name}: gathering experts {span[0]}..{span[1] - 1} over ep={mesh.size('ep')} gave "
                f"{tuple(full.shape)}, not {tuple(placement.full_shapes[name])}"
            )
    return full


def local_full_parameters(engine: Boosted) -> dict[str, Tensor]:
    """The full fp32 serial tensors of this rank's pipeline stages, by serial name (collective
    over tp, ep and, under ZeRO-3, dp). The tensors are fresh host copies, never views of
    parameters that ZeRO-3 frees again after gathering."""
    names = engine.placement.names
    with engine.zero.gathered():
        return {
            names[p]: full_tensor(engine, names[p], p.detach()).to("cpu", torch.float32, copy=True)
            for p in engine.module.parameters()
        }


def local_full_gradients(engine: Boosted) -> dict[str, Tensor]:
    """The full fp32 gradients of this rank's pipeline stages by serial name, as the optimizer
    is about to step them (summed over tp and pipeline copies, averaged over dp, unscaled,
    clipped): call it from an optimizer step pre-hook, on every rank. Collective: ZeRO's
    all-gathers over dp (``ZeroOptimizer.full_gradients``), then the tp shards joined as each
    parameter's ``ShardSpec`` says and expert banks gathered over ep (``full_tensor``), in
    serial-name order on every rank."""
    placement = engine.placement
    local = dict(engine.module.named_parameters())
    grads = {placement.names[local[n]]: g for n, g in engine.zero.full_gradients().items()}
    device = engine.mesh.device
    out = {}
    for name in sorted(grads):  # (ZeRO hands host copies; the gathers run on the mesh's device)
        out[name] = full_tensor(engine, name, grads[name].to(device)).to("cpu", torch.float32)
    return out


def consolidate(engine: Boosted, path: str | Path) -> dict[str, Tensor] | None:
    """Write the serial model's full fp32 state dict to ``path`` (safetensors); rank 0 also
    returns it, every other rank None. Collective over every rank: the stage groups' shards
    are written as ``export_sharded`` writes them (beside ``path``), rank 0 merges them into
    one file and removes them."""
    path = Path(path)
    parts = path.parent / f".{path.name}.parts"
    index = export_sharded(engine, parts)
    merged: dict[str, Tensor] | None = None
    error: BaseException | None = None
    if engine.mesh.rank == 0:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            merged = {}
            for shard in shards:
                merged.update(safetensors.torch.load((parts / shard).read_bytes()))
            atomic_write(path, safetensors.torch.save(merged))
            shutil.rmtree(parts)
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    raise_together(error, None, f"writing {path}", engine.mesh.device)
    return merged


def export_sharded(engine: Boosted, directory: str | Path) -> Path:
    """Write the serial model as a sharded safetensors checkpoint in Hugging Face's layout:
    ``model-0000K-of-0000P.safetensors`` per pipeline stage group, written by that group's
    (dp 0, tp 0) rank with only its own stages' parameters, then ``model.safetensors.index.json``
    (written last, by rank 0, from the shards' headers: the commit point). No rank holds more
    than its stages. A name held by two stages (a tied weight) is listed from the first shard.
    Collective over every rank; returns the index's path."""
    directory = Path(directory)
    mesh = engine.mesh
    pp = mesh.size("pp")
    full = local_full_parameters(engine)
    error: BaseException | None = None
    if mesh.coordinate("dp") == 0 and mesh.coordinate("tp") == 0:
        try:
            shard = directory / f"model-{mesh.coordinate('pp') + 1:05d}-of-{pp:05d}.safetensors"
            atomic_write(shard, safetensors.torch.save(full, metadata={"format": "pt"}))
        except (OSError, RuntimeError) as e:
            error = e
    raise_together(error, None, f"writing a shard under {directory}", mesh.device)
    index = directory / "model.safetensors.index.json"
    if mesh.rank == 0:
        try:
            weight_map: dict[str, str] = {}
            total = 0
            for k in range(pp):
                name = f"model-{k + 1:05d}-of-{pp:05d}.safetensors"
                for tensor, entry in SafeFile(directory / name).entries.items():
                    if tensor not in weight_map:
                        weight_map[tensor] = name
                        total += entry.nbytes
            missing = set(engine.placement.full_shapes) - set(weight_map)
            if missing:
                raise RuntimeError(f"the shards lack {len(missing)} parameters, e.g. {sorted(missing)[:5]}")
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write(index, json.dumps(body, indent=2).encode())
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    raise_together(error, None, f"writing {index}", mesh.device)
    return index
