"""Engine checkpoints: everything a run needs to continue its exact loss curve, at the same topology.

Layout of a checkpoint directory:

- ``rank-RRRRR.safetensors`` per rank: this rank's module state (its TP shards of its
  pipeline stages; buffers only under ZeRO-3, whose parameters live in the ZeRO shards) and
  its RNG state; the header metadata carries the scheduler state as JSON.
- ``zero/pp-P-tp-T/``: the ``tessera.zero`` checkpoint of each model-parallel slice (its own
  meta.json, checksums and world-size check over the dp group): masters and optimizer state.
- ``engine.json``, written by rank 0 last: format, step (the data position), topology,
  stage placement, ZeRO stage and the sha256 of every rank file. Its presence commits the
  checkpoint.

Every file is written atomically (temp file, fsync, rename). Nothing is unpickled. Loading
validates everything it can on every rank, then the ranks agree (``raise_together``) before
any collective, so a corrupt or mismatched file raises on every rank instead of hanging the
others.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from tessera.comm import all_gather, all_reduce
from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.launcher.placement import Boosted

__all__ = ["FORMAT", "Checkpointable", "load_engine", "read_meta", "save_engine"]

FORMAT = "tessera-engine/2"
META = "engine.json"


class Checkpointable(Boosted, Protocol):
    """What a checkpoint reads from and restores into (an ``Engine`` is one)."""

    @property
    def scheduler(self) -> Any: ...


def _layout(engine: Checkpointable) -> dict[str, Any]:
    t = engine.mesh.topology
    return {
        "topology": {
            "dp": t.dp, "pp": t.pp, "tp": t.tp, "sp": t.sp, "tp_mode": str(t.tp_mode), "depth": t.depth
        },
        "stage_to_rank": list(engine.placement.stage_to_rank),
        "zero_stage": engine.zero.stage,
    }


def _zero_dir(engine: Checkpointable, path: Path) -> Path:
    return path / "zero" / f"pp-{engine.mesh.coordinate('pp')}-tp-{engine.mesh.coordinate('tp')}"


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank-{rank:05d}.safetensors"


def _rank_tensors(engine: Checkpointable) -> tuple[dict[str, Tensor], dict[str, Any]]:
    module = engine.module  # under ZeRO-3 the parameters live in the ZeRO shards: keep the buffers
    state = dict(module.named_buffers()) if engine.zero.stage == 3 else module.state_dict()
    tensors = {f"module.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    header: dict[str, Any] = {
        "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
    }
    return tensors, header


def _sha(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)


def save_engine(engine: Checkpointable, step: int, path: str | Path) -> None:
    """Write the engine's full training state under ``path`` (collective over every rank)."""
    path = Path(path)
    rank, device = engine.mesh.rank, engine.mesh.device
    engine.zero.save(_zero_dir(engine, path))
    tensors, header = _rank_tensors(engine)
    data = safetensors.torch.save(tensors, metadata={"tessera": json.dumps(header)})
    error: BaseException | None = None
    try:
        atomic_write(_rank_file(path, rank), data)
    except OSError as e:
        error = e
    raise_together(error, None, f"writing {path}", device)
    digests = all_gather(_sha(data).to(device).reshape(1, 32), None).cpu()
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": engine.mesh.topology.world_size,
            **_layout(engine),
            "sha256": [bytes(d.tolist()).hex() for d in digests],
        }
        atomic_write(path / META, json.dumps(meta, indent=1).encode())
    all_reduce(torch.zeros(1, device=device), None)  # everyone returns after the commit


def read_meta(path: str | Path) -> dict[str, Any]:
    """The committed metadata of a checkpoint (ValueError if there is none)."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise ValueError(f"{path} holds no committed Tessera checkpoint ({META} is missing)")
    try:
        meta: dict[str, Any] = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _read_rank(
    engine: Checkpointable, path: Path
) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    """This rank's committed metadata, tensors and header, every check made (raises ValueError)."""
    meta = read_meta(path)
    mine = _layout(engine)
    saved = {k: meta.get(k) for k in mine}
    if saved != mine:
        raise ValueError(f"{path} was saved with {saved}; this run has {mine}")
    rank = engine.mesh.rank
    file = _rank_file(path, rank)
    data = file.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"][rank]:
        raise ValueError(f"{file} does not match its checksum in {META}")
    tensors = safetensors.torch.load(data)
    with safetensors.safe_open(str(file), "pt") as f:
        header: dict[str, Any] = json.loads(f.metadata()["tessera"])
    return meta, tensors, header


def load_engine(engine: Checkpointable, path: str | Path) -> int:
    """Restore what ``save_engine`` wrote, at the same topology, and return its step.

    Collective over every rank; every rank raises if any rank's files are missing, corrupt
    or from another layout, before any other collective.
    """
    path = Path(path)
    error: BaseException | None = None
    try:
        meta, tensors, header = _read_rank(engine, path)
    except (OSError, ValueError, KeyError, safetensors.SafetensorError) as e:
        error = e
    raise_together(error, None, f"reading the checkpoint {path}", engine.mesh.device)
    module = {k.removeprefix("module."): v for k, v in tensors.items() if k.startswith("module.")}
    engine.module.load_state_dict(module, strict=engine.zero.stage != 3)
    torch.set_rng_state(tensors["rng.cpu"])
    engine.zero.load(_zero_dir(engine, path))
    if engine.scheduler is not None and header["scheduler"] is not None:
        engine.scheduler.load_state_dict(header["scheduler"])
    return int(meta["step"])
