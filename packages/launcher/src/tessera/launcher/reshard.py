"""Checkpoints that load under another topology: each generation also holds its training
state in full, by serial parameter name, so that a run with other dp / pp / tp / sp degrees,
another tensor-parallel mode or another ZeRO stage resumes it exactly.

``portable/pp-K.safetensors`` (one per pipeline rank, written by its dp 0 / tp 0 / sp 0 rank):
for every parameter of the stages that rank holds, the fp32 master and each elementwise
optimizer state tensor (``param/<name>``, ``optim.<key>/<name>``; gathered over ZeRO's group,
then unsharded over tp by each parameter's ``ShardSpec``) and each optimizer group's scalar
state (``optim.step/group<i>``); its header holds the step, the optimizer groups'
hyperparameters (the learning rate a schedule reached) and the fp16 loss scale. Loading
reads every part, keeps each rank's tensor-parallel shard of each of its parameters and
hands them to ZeRO, which keeps its own shard (``tessera.zero.portable``). The files are
listed with their checksums in the generation's manifest like every other. Not carried
across topologies: the RNG state (the ranks' streams differ) and module buffers (the
reference models have none that are saved).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
from torch import Tensor

from tessera.comm.files import atomic_write
from tessera.launcher.consolidate import unshard
from tessera.launcher.placement import Boosted

__all__ = ["PORTABLE", "import_weights", "load_portable_state", "read_portable", "write_portable"]

PORTABLE = "portable"


def _part(gen: Path, pp_rank: int) -> Path:
    return gen / PORTABLE / f"pp-{pp_rank:03d}.safetensors"


def write_portable(engine: Boosted, gen: Path, step: int) -> None:
    """Write this pipeline rank's part under ``gen`` (collective over every rank: all-gathers
    over ZeRO's group and tp; one rank per pipeline rank writes)."""
    mesh, placement, zero = engine.mesh, engine.placement, engine.zero
    serial = {n: placement.names[p] for f in zero.flats for n, p in zip(f.names, f.params, strict=True)}
    tp, group = mesh.size("tp"), mesh.group("tp")
    out: dict[str, Tensor] = {}
    for key, value in zero.full_state().items():
        kind, _, name = key.partition("/")
        if name.startswith("group") and name not in serial:
            out[key] = value
            continue
        full_name = serial[name]
        spec = placement.shard_specs.get(full_name)
        out[f"{kind}/{full_name}"] = unshard(value, spec, placement.full_shapes[full_name], tp, group).cpu()
    if all(mesh.coordinate(axis) == 0 for axis in ("dp", "tp", "sp")):
        scaler = zero.scaler.scale if zero.scaler is not None else None
        groups = [
            {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple))}
            for g in zero.optimizer.param_groups
        ]
        header = {"step": step, "loss_scale": scaler, "zero_steps": zero.steps, "param_groups": groups}
        data = safetensors.torch.save(out, metadata={"tessera": json.dumps(header)})
        atomic_write(_part(gen, mesh.coordinate("pp")), data)


def read_portable(gen: Path, pp: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every part of the portable state of generation ``gen`` saved with ``pp`` pipeline
    ranks, merged, and the header of the first (ValueError/OSError naming a missing part)."""
    merged: dict[str, Tensor] = {}
    header: dict[str, Any] = {}
    for k in range(pp):
        part = _part(gen, k)
        if not part.is_file():
            missing = part.relative_to(gen)
            raise ValueError(f"{gen} has no {missing}: it cannot be loaded under another topology")
        with safetensors.safe_open(str(part), "pt") as f:
            header = header or json.loads(f.metadata()["tessera"])
        merged.update(safetensors.torch.load(part.read_bytes()))
    return merged, header


def load_portable_state(engine: Boosted, state: dict[str, Tensor], header: dict[str, Any]) -> None:
    """Give this rank's ZeRO its parameters' tensor-parallel shards of ``state``; local."""
    mesh, placement, zero = engine.mesh, engine.placement, engine.zero
    tp, tp_rank = mesh.size("tp"), mesh.coordinate("tp")
    kinds = sorted({k.split("/", 1)[0] for k in state if "/group" not in k})
    local: dict[str, Tensor] = {k: v for k, v in state.items() if "/group" in k}
    for flat in zero.flats:
        for name, param in zip(flat.names, flat.params, strict=True):
            full_name = placement.names[param]
            spec = placement.shard_specs.get(full_name)
            for kind in kinds:
                full = state.get(f"{kind}/{full_name}")
                if full is None:
                    raise ValueError(f"the saved state lacks {kind}/{full_name}")
                shard = full if spec is None else spec.shard(full, tp_rank, tp)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{kind}/{full_name}: the saved {tuple(full.shape)} gives a shard of "
                        f"{tuple(shard.shape)} on tp rank {tp_rank}, the parameter is {tuple(param.shape)}"
                    )
                local[f"{kind}/{name}"] = shard
    zero.load_full_state(local, int(header.get("zero_steps", zero.steps)))
    saved_groups = header.get("param_groups", [{} for _ in zero.optimizer.param_groups])
    if len(saved_groups) != len(zero.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} optimizer groups, this optimizer "
            f"{len(zero.optimizer.param_groups)}"
        )
    for group, saved in zip(zero.optimizer.param_groups, saved_groups, strict=True):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    if zero.scaler is not None and header.get("loss_scale") is not None:
        zero.scaler.scale = float(header["loss_scale"])


def import_weights(engine: Boosted, path: Path) -> None:
    """Load a consolidated state dict (``Engine.consolidate``'s file, or any safetensors file
    of the serial model's parameters by name, e.g. a Hugging Face checkpoint of the same
    model) into this rank's shards; the optimizer state starts fresh. Local (each rank reads
    the file); ValueError naming a missing or misshapen parameter."""
    with safetensors.safe_open(str(path), "pt") as f:
        wanted = {engine.placement.names[p] for flat in engine.zero.flats for p in flat.params}
        missing = sorted(wanted - set(f.keys()))
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} parameters of the model, e.g. {missing[:5]}")
        state = {f"param/{name}": f.get_tensor(name).float() for name in wanted}
    load_portable_state(engine, state, {})
