"""Engine checkpoints as generations: a save never costs the previous one.

A checkpoint root holds one directory per save, ``step-NNNNNNNN/``:

- ``rank-RRRRR.safetensors`` per rank: this rank's module state (its TP shards of its
  pipeline stages; buffers only under ZeRO-3, whose parameters live in the ZeRO shards), its
  RNG state, and a header with the step and the scheduler state.
- ``zero/pp-P-tp-T/``: the ``tessera.zero`` checkpoint of each model-parallel slice.
- ``manifest.json``, written last and atomically: the commit point. It lists every file of
  the generation with its sha256, and the step (the data position), the topology, the stage
  placement, the ZeRO stage and the configuration that shapes the state.

``latest`` in the root names the newest committed generation (a convenience; loading scans).
Without shared storage (each node its own folder, ``tessera.launcher.checkpoint.storage``) every file
is kept in two nodes' folders and each folder has the manifest; a load first copies into
each folder what it lacks of the generation it loads, so a node that lost its disk, or a
job restarted on fewer nodes, loads the same generation.
A save uncommits a committed generation of the same step before rewriting it; after the
commit, generations beyond ``keep_last`` and torn saves older than the new one are removed.

Loading resolves the root to its newest committed generation (or takes a generation
directory), and every rank checks the manifest against this run, its share of the files
against their checksums and its rank file's step against the manifest, before any
collective; then the ranks agree (``raise_together``): a missing, corrupt, edited or foreign
file raises on every rank with one line naming it, and the engine is left as it was.
Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from tessera.comm.consensus import raise_together
from tessera.comm.safefile import SafeFile
from tessera.launcher.checkpoint.fingerprint import LAYOUT_SECTIONS, sha256
from tessera.launcher.checkpoint.fingerprint import differences as _differences
from tessera.launcher.checkpoint.fingerprint import fingerprint as _fingerprint
from tessera.launcher.checkpoint.generations import (
    FORMAT,
    MANIFEST,
    committed_generations,
    read_manifest,
    resolve_generation,
)
from tessera.launcher.checkpoint.reshard import PORTABLE, load_portable_state, read_portable
from tessera.launcher.checkpoint.saving import (
    BackgroundSave,
    Checkpointable,
    begin_save,
    layout,
    zero_dir,
)
from tessera.launcher.checkpoint.storage import gather_generation

__all__ = [
    "FORMAT",
    "MANIFEST",
    "BackgroundSave",
    "Checkpointable",
    "committed_generations",
    "load_engine",
    "resolve_generation",
    "save_engine",
]

log = logging.getLogger(__name__)

_READ_ERRORS = (OSError, ValueError, KeyError, json.JSONDecodeError, safetensors.SafetensorError)


def save_engine(
    engine: Checkpointable, step: int, root: str | Path, *, keep_last: int = 2, background: bool = False
) -> Path | BackgroundSave:
    """Write a new generation of the engine's training state under ``root``; collective over
    every rank. At once: committed on return, its directory returned. ``background``: returns
    once the state is copied to host memory, with the writer running (``saving``);
    ``BackgroundSave.finish`` commits it."""
    pending = begin_save(engine, step, Path(root), keep_last=keep_last, background=background)
    if not background:
        pending.write()
        return pending.commit()
    log.info(
        "checkpoint %s: %.1f MiB copied to host memory on rank %d, written in the background",
        pending.generation,
        pending.copied / 2**20,
        engine.mesh.rank,
    )
    return BackgroundSave(pending)


# ---------------------------------------------------------------------------- load
def _check(
    engine: Checkpointable, gen: Path, manifest: dict[str, Any]
) -> tuple[Path, dict[str, Any], Mapping[str, Tensor], dict[str, Any]]:
    """This rank's share of the checks of generation ``gen`` (its ``manifest`` read); returns
    the generation, its manifest, this rank's tensors and header (raises ValueError/OSError
    naming the file)."""
    changed = _differences(manifest["config"], _fingerprint(engine.config))
    if changed:
        raise ValueError(f"{gen} was saved under another configuration: {'; '.join(changed[:6])}")
    rank, world = engine.mesh.rank, engine.mesh.topology.world_size
    own = gen / f"rank-{rank:05d}.safetensors"
    data = own.read_bytes()
    share = sorted(manifest["files"])[rank::world]
    own_sum = hashlib.sha256(data).hexdigest()
    for rel in share:
        if (own_sum if rel == own.name else sha256(gen / rel)) != manifest["files"][rel]:
            raise ValueError(f"{gen / rel} does not match its checksum in {MANIFEST}")
    if own.name not in share and own_sum != manifest["files"].get(own.name):
        raise ValueError(f"{own} does not match its checksum in {MANIFEST}")
    header: dict[str, Any] = json.loads(SafeFile(own, data).metadata["tessera"])
    if header["step"] != manifest["step"]:
        raise ValueError(f"{gen / MANIFEST} says step {manifest['step']}, {own.name} step {header['step']}")
    tensors = safetensors.torch.load(data)
    module = engine.module  # under ZeRO-3 the rank file holds the buffers (ZeRO checks the rest)
    state = dict(module.named_buffers()) if engine.zero.stage == 3 else module.state_dict()
    saved = {k.removeprefix("module."): tuple(v.shape) for k, v in tensors.items() if k.startswith("module.")}
    mismatch = _mismatch(saved, {k: tuple(v.shape) for k, v in state.items()})
    if mismatch:
        raise ValueError(f"{own} does not match this model: {mismatch}")
    return gen, manifest, tensors, header


def _mismatch(saved: Mapping[str, tuple[int, ...]], mine: Mapping[str, tuple[int, ...]]) -> str:
    """The first tensor whose name or shape differs between a checkpoint and the model ("" if none)."""
    for name in sorted(mine):
        if name not in saved:
            return f"it has no tensor {name!r} (this model's, of shape {list(mine[name])})"
        if saved[name] != mine[name]:
            return f"{name!r} is saved with shape {list(saved[name])}, this model's is {list(mine[name])}"
    extra = sorted(set(saved) - set(mine))
    return f"it holds {extra[0]!r}, which this model does not have" if extra else ""


def _same_layout(engine: Checkpointable, manifest: dict[str, Any]) -> bool:
    mine = layout(engine)
    return {k: manifest.get(k) for k in mine} == mine


def _check_portable(
    engine: Checkpointable, gen: Path, manifest: dict[str, Any]
) -> tuple[Path, dict[str, Any], Mapping[str, Tensor], dict[str, Any]]:
    """The checks of a generation saved under another topology: the configuration but its
    parallel and zero sections, and the checksums of the portable parts every rank reads."""
    saved = {k: v for k, v in manifest["config"].items() if k not in LAYOUT_SECTIONS}
    mine = {k: v for k, v in _fingerprint(engine.config).items() if k not in LAYOUT_SECTIONS}
    changed = _differences(saved, mine)
    if changed:
        raise ValueError(f"{gen} was saved under another configuration: {'; '.join(changed[:6])}")
    for rel, digest in manifest["files"].items():
        if rel.startswith(PORTABLE + "/") and sha256(gen / rel) != digest:
            raise ValueError(f"{gen / rel} does not match its checksum in {MANIFEST}")
    state, header = read_portable(gen, int(manifest["topology"]["pp"]))
    for name, shape in engine.placement.full_shapes.items():  # this rank's stages' parameters
        key = f"param/{name}"
        if key not in state:
            raise ValueError(f"{gen / PORTABLE} does not match this model: it has no parameter {name!r}")
        if tuple(state.shape(key)) != tuple(shape):
            raise ValueError(
                f"{gen / PORTABLE} does not match this model: {name!r} is saved with shape "
                f"{list(state.shape(key))}, this model's is {list(shape)}"
            )
    if header["step"] != manifest["step"]:
        saved = manifest["step"]
        raise ValueError(f"{gen / MANIFEST} says step {saved}, its portable state step {header['step']}")
    first = SafeFile(gen / "rank-00000.safetensors")
    header["scheduler"] = json.loads(first.metadata["tessera"])["scheduler"]
    return gen, manifest, state, header


def load_engine(engine: Checkpointable, path: str | Path) -> tuple[int, Path]:
    """Restore the newest committed generation under ``path`` (or the generation ``path``);
    returns its step and directory. Saved under this topology and ZeRO stage, every rank reads
    its own files (and its RNG state); under another, the portable state (``reshard``).
    Collective over every rank; every rank raises if any rank's check fails, before any other
    collective."""
    path = Path(path)
    device = engine.mesh.device
    named = re.fullmatch(r"step-(\d{8})", path.name)  # a generation, by name: it may not be here yet
    root = path.parent if named else path
    storage = engine.checkpoint_storage(root)
    error: BaseException | None = None
    same = True
    try:
        if storage.shared:
            gen = resolve_generation(path)
        else:  # the generation is made whole in every node's folder first (collective)
            gen = gather_generation(root, storage, int(named.group(1)) if named else None, device)
        manifest = read_manifest(gen)
        same = _same_layout(engine, manifest)
        check = _check if same else _check_portable
        gen, manifest, tensors, header = check(engine, gen, manifest)
    except _READ_ERRORS as e:
        error = e
    raise_together(error, None, f"reading the checkpoint {path}", device)
    if not same:
        load_portable_state(engine, tensors, header)
        if engine.scheduler is not None and header["scheduler"] is not None:
            engine.scheduler.load_state_dict(header["scheduler"])
        topology = engine.mesh.topology.describe()
        log.info("loaded %s saved under %s into %s", gen, manifest["topology"], topology)
        raise_together(None, None, "loading", device)
        return int(manifest["step"]), gen
    module = {k.removeprefix("module."): v for k, v in tensors.items() if k.startswith("module.")}
    engine.module.load_state_dict(module, strict=engine.zero.stage != 3)
    torch.set_rng_state(tensors["rng.cpu"])
    engine.zero.load(zero_dir(engine, gen))
    if engine.scheduler is not None and header["scheduler"] is not None:
        engine.scheduler.load_state_dict(header["scheduler"])
    raise_together(None, None, "loading", device)  # every rank has loaded before anyone goes on
    return int(manifest["step"]), gen
