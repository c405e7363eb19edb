"""Engine checkpoints: everything a run needs to continue its exact loss curve, at the same topology.

Layout of a checkpoint directory:

- ``rank-RRRRR.safetensors`` per rank: this rank's module state (its TP shards of its
  pipeline stages), its RNG states and, without ZeRO, its optimizer state tensors; the
  header metadata carries the scheduler state and optimizer hyperparameters as JSON.
- ``zero/pp-P-tp-T/``: with ZeRO, the ``tessera.zero`` checkpoint of each model-parallel
  slice (its own meta.json, checksums and world-size check over the dp group).
- ``engine.json``, written by rank 0 last: format, step (the data position), topology,
  ZeRO stage and the sha256 of every rank file. Its presence commits the checkpoint.

Every file is written atomically (temp file, fsync, rename). Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from torch import Tensor

from tessera.comm import all_gather, all_reduce
from tessera.comm.files import atomic_write

if TYPE_CHECKING:
    from tessera.launcher.engine import Engine

__all__ = ["FORMAT", "load_engine", "save_engine"]

FORMAT = "tessera-engine/1"
META = "engine.json"


def _topology(engine: Engine) -> dict[str, int]:
    p = engine.config.parallel
    return {"dp": p.dp, "pp": p.pp, "tp": p.tp, "sp": p.sp, "virtual_stages": p.virtual_stages}


def _zero_dir(engine: Engine, path: Path) -> Path:
    return path / "zero" / f"pp-{engine.mesh.coordinate('pp')}-tp-{engine.mesh.coordinate('tp')}"


def _rank_tensors(engine: Engine) -> tuple[dict[str, Tensor], dict[str, Any]]:
    state = engine.module.state_dict()
    if engine.config.zero.stage == 3:  # parameters live in the ZeRO shards; keep the buffers
        state = {name: buf for name, buf in engine.module.named_buffers()}
    tensors = {f"module.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    header: dict[str, Any] = {
        "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
    }
    if engine.zero is None:
        state = engine.optimizer.state_dict()
        for index, per_param in state["state"].items():
            for key, value in per_param.items():
                tensors[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
        header["optim_groups"] = state["param_groups"]
    return tensors, header


def _sha(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)


def save_engine(engine: Engine, path: str | Path) -> None:
    """Write the engine's full training state under ``path`` (collective over every rank)."""
    path = Path(path)
    rank = engine.mesh.rank
    if engine.zero is not None:
        engine.zero.save(_zero_dir(engine, path))
    tensors, header = _rank_tensors(engine)
    data = safetensors.torch.save(tensors, metadata={"tessera": json.dumps(header)})
    atomic_write(path / f"rank-{rank:05d}.safetensors", data)
    digests = all_gather(_sha(data).to(engine.mesh.device).reshape(1, 32), None).cpu()
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": engine.step,
            "world_size": engine.config.world_size,
            "topology": _topology(engine),
            "zero_stage": engine.config.zero.stage,
            "sha256": [bytes(d.tolist()).hex() for d in digests],
        }
        atomic_write(path / META, json.dumps(meta, indent=1).encode())
    all_reduce(torch.zeros(1, device=engine.mesh.device), None)  # everyone returns after the commit


def read_meta(path: str | Path) -> dict[str, Any]:
    """The committed metadata of a checkpoint (ValueError if there is none)."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise ValueError(f"{path} holds no committed Tessera checkpoint ({META} is missing)")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_engine(engine: Engine, path: str | Path) -> None:
    """Restore what ``save_engine`` wrote, at the same topology (collective over every rank)."""
    path = Path(path)
    meta = read_meta(path)
    if meta["topology"] != _topology(engine) or meta["zero_stage"] != engine.config.zero.stage:
        raise ValueError(
            f"{path} was saved with topology {meta['topology']} and zero stage {meta['zero_stage']}; "
            f"this run has {_topology(engine)} and zero stage {engine.config.zero.stage}"
        )
    rank = engine.mesh.rank
    data = (path / f"rank-{rank:05d}.safetensors").read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"][rank]:
        raise ValueError(f"{path}/rank-{rank:05d}.safetensors does not match its checksum in {META}")
    tensors = safetensors.torch.load(data)
    with safetensors.safe_open(str(path / f"rank-{rank:05d}.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["tessera"])
    module = {k.removeprefix("module."): v for k, v in tensors.items() if k.startswith("module.")}
    engine.module.load_state_dict(module, strict=engine.config.zero.stage != 3)
    torch.set_rng_state(tensors["rng.cpu"])
    if engine.zero is not None:
        engine.zero.load(_zero_dir(engine, path))
    else:
        state: dict[int, dict[str, Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        engine.optimizer.load_state_dict({"state": state, "param_groups": header["optim_groups"]})
    if engine.scheduler is not None and header["scheduler"] is not None:
        engine.scheduler.load_state_dict(header["scheduler"])
    engine.step = int(meta["step"])
