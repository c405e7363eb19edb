"""Gather an engine's parameters back into the serial model's full state dict.

Tensor-parallel shards are all-gathered over tp along the one dimension where the local
shape is 1/tp of the serial shape (column, row, vocabulary or position splits are all
contiguous chunks in rank order); ZeRO-3 shards are gathered by ``ZeroOptimizer.gathered``;
pipeline stages meet in files: the (dp 0, tp 0) rank of every stage writes its part and
global rank 0 merges them. Collective over every rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from torch import Tensor

from tessera.comm import Group, all_gather, all_reduce

if TYPE_CHECKING:
    from tessera.launcher.engine import Engine

__all__ = ["consolidate", "unshard"]


def unshard(local: Tensor, full_shape: tuple[int, ...], tp: int, group: Group) -> Tensor:
    """The full tensor of a tp-sharded ``local`` (all-gather along its split dimension)."""
    if tuple(local.shape) == full_shape:
        return local
    dims = [d for d, (a, b) in enumerate(zip(local.shape, full_shape, strict=True)) if a != b]
    if len(dims) != 1 or local.shape[dims[0]] * tp != full_shape[dims[0]]:
        raise ValueError(f"cannot unshard shape {tuple(local.shape)} into {full_shape} over tp={tp}")
    return all_gather(local.detach().contiguous(), group, dims[0])


def consolidate(engine: Engine, path: str | Path) -> dict[str, Tensor] | None:
    """Write the serial model's full fp32 state dict to ``path`` (safetensors); rank 0 also
    returns it, every other rank None."""
    path = Path(path)
    parts = path.parent / f".{path.name}.parts"
    parts.mkdir(parents=True, exist_ok=True)
    names = engine.placement.names
    tp = engine.config.parallel.tp
    with engine.zero.gathered() if engine.zero is not None else contextlib.nullcontext():
        full = {
            names[p]: unshard(p.detach(), engine.placement.full_shapes[names[p]], tp, engine.tp).float().cpu()
            for p in engine.module.parameters()
        }
    writer = engine.mesh.coordinate("dp") == 0 and engine.mesh.coordinate("tp") == 0
    if writer:
        safetensors.torch.save_file(full, str(parts / f"stage-{engine.mesh.coordinate('pp')}.safetensors"))
    all_reduce(torch.zeros(1, device=engine.mesh.device), None)  # every part is on disk
    merged: dict[str, Tensor] | None = None
    if engine.mesh.rank == 0:
        merged = {}
        for part in sorted(parts.glob("stage-*.safetensors")):
            merged.update(safetensors.torch.load_file(str(part)))
        missing = set(engine.placement.full_shapes) - set(merged)
        if missing:
            raise RuntimeError(f"consolidated state lacks {sorted(missing)[:5]}")
        tmp = path.with_name(f".{path.name}.tmp")
        safetensors.torch.save_file(merged, str(tmp))
        tmp.replace(path)
        for part in parts.glob("*"):
            part.unlink()
        parts.rmdir()
    all_reduce(torch.zeros(1, device=engine.mesh.device), None)
    return merged
