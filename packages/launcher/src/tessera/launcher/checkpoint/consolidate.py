"""Gather a boosted model's parameters back into the serial model's full state dict.

Tensor-parallel shards are all-gathered over tp and joined as the parameter's ``ShardSpec``
says (recorded by ``parallelize``, kept in the ``Placement``; nothing is inferred from
shapes); an expert bank split over the ep group is then all-gathered over it along the
experts (``Placement.experts``). ``local_full_parameters`` (a rank's stages at once) has ZeRO-3
gather them (``ZeroOptimizer.gathered``); an export streams ZeRO's fp32 masters one flat
buffer at a time instead (``ZeroOptimizer.iter_full_state(params_only=True)``), into shards
that the ranks of each pipeline stage group write in turn, so no rank holds the whole model;
``consolidate`` merges those shards on rank 0 into one file. Every file is written
atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor

from tessera.comm import Group, all_gather
from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.comm.safefile import Entry, SafeFile, StreamWriter, tensor_bytes
from tessera.launcher.checkpoint.exported import ExportView, Joiner, export_names, export_shapes, parts_of
from tessera.launcher.checkpoint.placement import Boosted
from tessera.tensor_parallel import ShardSpec

__all__ = [
    "MAX_SHARD_BYTES",
    "consolidate",
    "export_sharded",
    "full_tensor",
    "local_full_gradients",
    "local_full_parameters",
    "split_shards",
    "streamed_names",
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
    returns it, every other rank None. A tied parameter is written under each of its names
    (HF's ``lm_head.weight`` beside the embedding), so a strict ``load_state_dict`` of the
    serial model takes the file. Collective over every rank: the stage groups' shards
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
            for alias, name in engine.placement.aliases.items():  # a tied head under its own name too
                merged[alias] = merged[name].clone()
            atomic_write(path, safetensors.torch.save(merged))
            shutil.rmtree(parts)
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    raise_together(error, None, f"writing {path}", engine.mesh.device)
    return merged


MAX_SHARD_BYTES = 2**30  # an export's shard holds at most this many bytes (or one larger tensor)


def split_shards(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """``entries`` cut in order into runs of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if out[-1] and size + e.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.nbytes
    return out if out[0] else []


def streamed_names(engine: Boosted, *, trained_only: bool = False) -> list[str]:
    """The serial names of this rank's parameters in the order ``iter_full_state(params_only=True,
    trained_only=...)`` streams their fp32 masters (no communication)."""
    placement, zero = engine.placement, engine.zero
    serial = {n: placement.names[p] for f in zero.flats for n, p in zip(f.names, f.params, strict=True)}
    layout = zero.full_state_layout(params_only=True, trained_only=trained_only)
    return [serial[key.partition("/")[2]] for key, _ in layout]


def _write_shards(
    engine: Boosted, directory: Path, max_shard_bytes: int, dtype: torch.dtype, view: ExportView | None
) -> tuple[int, BaseException | None]:
    """Stream this pipeline rank's fp32 masters, one ZeRO flat buffer at a time, each gathered
    over tp and ep (``full_tensor``), into its shards; shard ``j`` is written by the ``j``-th
    rank of the pipeline rank's group (round robin; a tensor joined from several parameters,
    HF's ``gate_up_proj`` from ``w1`` and ``w3``, when its last piece has streamed), then the
    stage's persistent buffers as they are held (``Placement.buffers``, under the names
    ``Placement.exported`` gives them). Collective; returns how many shards the model has in
    all and this rank's error, if any (it still takes part to the end)."""
    mesh, placement, zero = engine.mesh, engine.placement, engine.zero
    names = streamed_names(engine)
    exported = placement.exported if view is None else view.exported
    added = {} if view is None else view.added
    parts = [parts_of(n, exported) for n in names]  # the user's names, where boost() renamed
    shapes = export_shapes({n: placement.full_shapes[n] for n in names}, exported)
    entries = [Entry(name, dtype, shape) for name, shape in shapes.items()]
    joiner = Joiner(exported, names)  # a tensor joined from several parameters: when complete
    held = dict(engine.module.named_buffers())
    buffers = sorted(
        (part.name, held[local] if part.view is None else held[local].reshape(part.view))
        for local, serial in placement.buffers.items()
        for part in parts_of(serial, exported)[:1]
    )
    entries += [Entry(n, dtype if b.is_floating_point() else b.dtype, tuple(b.shape)) for n, b in buffers]
    shards = split_shards(entries, max_shard_bytes)
    counts = all_gather(torch.tensor([len(shards)], device=mesh.device), mesh.group("pp"), 0)
    p, topology = mesh.coordinate("pp"), mesh.topology
    first, total = int(counts[:p].sum()), int(counts.sum())
    group = [r for r in range(topology.world_size) if topology.coordinate(r, "pp") == p]
    owner = [j for j, shard in enumerate(shards) for _ in shard]  # each entry's shard
    error: BaseException | None = None
    k = 0  # the entry written next
    writer: StreamWriter | None = None

    def write(stack: contextlib.ExitStack, tensor: Tensor) -> None:
        nonlocal k, writer, error
        j, k = owner[k], k + 1
        if group[j % len(group)] != mesh.rank or error is not None:
            return
        try:
            if writer is None:
                target = directory / f"model-{first + j + 1:05d}-of-{total:05d}.safetensors"
                meta = {"format": "pt", "tessera.rank": str(mesh.rank)}  # which rank wrote it
                writer = stack.enter_context(StreamWriter(target, shards[j], meta))
            writer.write(tensor_bytes(tensor.to("cpu", entries[k - 1].dtype).contiguous()))
            if k == len(owner) or owner[k] != j:
                writer.commit()
                writer = None
        except (OSError, RuntimeError, ValueError) as e:
            error = e

    with contextlib.ExitStack() as stack:
        for i, (_, value) in enumerate(zero.iter_full_state(params_only=True)):
            full = full_tensor(engine, names[i], value.to(mesh.device))  # collective over tp and ep
            if names[i] in added:
                full = full.to(torch.float32) + added[names[i]].to(full.device, torch.float32)
            for part in parts[i]:
                tensor = joiner.add(part, part.take(full))
                if tensor is not None:
                    write(stack, tensor)
        for _, buffer in buffers:  # held whole on every rank of the stage: no collective
            write(stack, buffer)
    return total, error


def export_sharded(
    engine: Boosted,
    directory: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: torch.dtype = torch.float32,
    view: ExportView | None = None,
) -> Path:
    """Write the serial model (its parameters, then its persistent buffers: whatever a strict
    load expects) as a sharded safetensors checkpoint in Hugging Face's layout:
    ``model-0000K-of-0000N.safetensors`` of at most ``max_shard_bytes`` each (a larger tensor
    alone), every pipeline rank's parameters in shards of their own, each shard written by one
    rank of that pipeline rank's group in turn as the fp32 masters stream past one ZeRO flat
    buffer at a time (each tensor gathered over tp and ep), so no rank holds more than one flat
    buffer's parameters; then ``model.safetensors.index.json`` (written last, by rank 0, from
    the shards' headers: the commit point). A name held by two stages (a tied weight) is
    listed from the first shard. ``dtype``: the tensors' type in the files (the fp32 masters
    rounded to it, e.g. ``torch.bfloat16`` for half the bytes); a floating type, else
    ValueError before anything is written. ``view``: other names and additions than the
    placement's (`ExportView`: adapters merged into their base layers). Collective over every
    rank; returns the index's path."""
    if not dtype.is_floating_point:
        raise ValueError(f"export dtype must be a floating type, got {dtype}")
    directory = Path(directory)
    mesh = engine.mesh
    shards, error = _write_shards(engine, directory, max_shard_bytes, dtype, view)
    raise_together(error, None, f"writing a shard under {directory}", mesh.device)
    index = directory / "model.safetensors.index.json"
    if mesh.rank == 0:
        try:
            weight_map: dict[str, str] = {}
            total = 0
            for k in range(shards):
                name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
                for tensor, entry in SafeFile(directory / name).entries.items():
                    if tensor not in weight_map:
                        weight_map[tensor] = name
                        total += entry.nbytes
            exported = engine.placement.exported if view is None else view.exported
            missing = set(export_names(list(engine.placement.full_shapes), exported))
            missing -= set(weight_map)
            if missing:
                raise RuntimeError(f"the shards lack {len(missing)} parameters, e.g. {sorted(missing)[:5]}")
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write(index, json.dumps(body, indent=2).encode())
        except (OSError, RuntimeError, ValueError) as e:
            error = e
    raise_together(error, None, f"writing {index}", mesh.device)
    return index
