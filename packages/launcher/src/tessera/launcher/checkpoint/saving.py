"""Writing an engine checkpoint generation (``checkpoint``), at once or in the background.

A save has three phases:

1. ``begin_save`` (the training thread, collective): rank 0 uncommits a generation of the
   same step; then each rank takes what it will write. At once (``background=False``) the
   ZeRO shard and the portable state are written here, streamed from the engine's tensors.
   In the background, every tensor the save writes is copied to host memory once here (the
   rank file's module, RNG and scheduler state; the ZeRO shard, ``ZeroOptimizer.begin_save``;
   the portable state, gathered over ZeRO's group and tp: the only collectives of the
   writing); the bytes copied are counted and logged.
2. ``PendingSave.write`` (no collective; in the background, a thread of its own while
   training goes on): the files from that copy, each hashed as it is written, then this
   rank's checksums, ``.sha-RRRRR.json``. An error is kept, naming the file.
3. ``PendingSave.commit`` (the training thread, collective): every rank raises if any rank's
   write failed; the ZeRO groups agree on their shards (``meta.json``); rank 0 merges the
   checksums into the manifest, the commit point, and prunes.

Without shared storage (``storage``: the ranks of each node write into their own node's
folder), the commit first copies every file to a second node's folder (``storage.spread``),
then the lowest rank of each folder writes the same manifest there, listing which folders
hold each file, and prunes its folder.

The writer thread never runs a collective: gloo's groups are not safe under concurrent
operations from two threads, and training's collectives go on meanwhile. The agreement is
made from the training thread instead, when it next saves, waits (``Engine.wait_for_save``)
or closes the engine. So a background generation is committed at the next save (or wait,
or close), not when its files are written: a kill before that leaves it torn, and loading
takes the generation before it. One save is pending at most: a save first commits the one
before.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from tessera.comm import group_rank
from tessera.comm.blobs import all_gather_bytes
from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.launcher.checkpoint.fingerprint import fingerprint, sha256
from tessera.launcher.checkpoint.generations import (
    FORMAT,
    LATEST,
    MANIFEST,
    committed_generations,
    generation_name,
)
from tessera.launcher.checkpoint.placement import Boosted
from tessera.launcher.checkpoint.reshard import snapshot_portable, write_portable
from tessera.launcher.checkpoint.storage import REPLICAS, Storage, spread
from tessera.launcher.config import BoostConfig
from tessera.zero.checkpoint import ShardSave, rank_file, replicated_checkpoint, write_tensors

__all__ = ["BackgroundSave", "Checkpointable", "PendingSave", "begin_save", "fingerprint", "layout"]

log = logging.getLogger(__name__)


class Checkpointable(Boosted, Protocol):
    """What a checkpoint reads from and restores into (an ``Engine`` is one)."""

    @property
    def scheduler(self) -> Any: ...
    @property
    def config(self) -> BoostConfig: ...
    def checkpoint_storage(self, root: Path) -> Storage: ...


def layout(engine: Checkpointable) -> dict[str, Any]:
    """The topology, stage placement and ZeRO stage a generation is saved under."""
    t = engine.mesh.topology
    return {
        "world_size": t.world_size,
        "topology": {
            "dp": t.dp,
            "pp": t.pp,
            "tp": t.tp,
            "cp": t.cp,
            "tp_mode": str(t.tp_mode),
            "tp_depth": t.tp_depth,
            **({"ep": t.ep} if t.ep > 1 else {}),
        },
        "stage_to_rank": list(engine.placement.stage_to_rank),
        "zero_stage": engine.zero.stage,
    }


def generation_files(generation: Path) -> list[str]:
    """Every file of a generation but the manifest and hidden staging files, relative, sorted."""
    return sorted(
        str(p.relative_to(generation))
        for p in generation.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )


def zero_dir(engine: Checkpointable, generation: Path) -> Path:
    """Where this rank's model-parallel slice keeps its ZeRO checkpoint in ``generation``."""
    return generation / "zero" / f"pp-{engine.mesh.coordinate('pp')}-tp-{engine.mesh.coordinate('tp')}"


def _rank_tensors(engine: Checkpointable, step: int, copy: bool) -> tuple[dict[str, Tensor], dict[str, str]]:
    module = engine.module  # under ZeRO-3 the parameters live in the ZeRO shards: keep the buffers
    state = dict(module.named_buffers()) if engine.zero.stage == 3 else module.state_dict()
    if copy:  # host tensors too: training changes them in place
        tensors = {f"module.{k}": v.detach().to("cpu", copy=True) for k, v in state.items()}
    else:
        tensors = {f"module.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    scheduler = engine.scheduler.state_dict() if engine.scheduler is not None else None
    return tensors, {"tessera": json.dumps({"step": step, "scheduler": scheduler})}


Write = Callable[[], str]  # writes (or only hashes) one file; its hex sha256


@dataclass
class PendingSave:
    """A generation begun by ``begin_save``: ``write`` (any thread), then ``commit``."""

    engine: Checkpointable
    step: int
    root: Path
    generation: Path
    keep_last: int
    storage: Storage  # who shares the folder ``root``
    writes: list[tuple[str, Write]]  # (path in the generation, what writes it)
    copied: int = 0  # bytes copied to host memory for the writer
    shard: ShardSave | None = None  # background: the ZeRO shard's agreement is the commit's
    error: BaseException | None = field(default=None, repr=False)

    def write(self) -> None:
        """Write this rank's files and checksums; no collective. Keeps the first error."""
        gen, rank = self.generation, self.engine.mesh.rank
        sums: dict[str, str] = {}
        current = gen / f".sha-{rank:05d}.json"
        try:
            for rel, write in self.writes:
                current = gen / rel
                sums[rel] = write()
            current = gen / f".sha-{rank:05d}.json"
            atomic_write(current, json.dumps(sums).encode())
        except Exception as e:
            self.error = OSError(f"writing {current}: {type(e).__name__}: {e}")
            self.error.__cause__ = e

    def commit(self) -> Path:
        """Collective over every rank, from the training thread: agree every rank wrote, the
        ZeRO shards' ``meta.json``; without shared storage copy each file to a second folder;
        then rank 0 (each folder's lowest rank) writes the manifest and prunes."""
        gen, device, storage = self.generation, self.engine.mesh.device, self.storage
        raise_together(self.error, None, f"writing the checkpoint {gen}", device)
        error: BaseException | None = None
        if self.shard is not None:
            try:
                self.shard.commit()  # collective over the ZeRO group only (one tp rank's, say)
            except Exception as e:
                error = e
        # over every rank: each group's meta.json is on disk before any folder's sums are read
        raise_together(error, None, f"writing the ZeRO shards' meta.json ({gen})", device)
        holders = None if storage.shared else spread(gen, storage, REPLICAS, device)
        sums: dict[str, str] = {}
        if storage.leader:
            try:
                sums = _local_sums(gen)
            except OSError as e:
                error = e
        raise_together(error, None, f"reading the checksums ({gen})", device)
        if holders is not None:  # every folder's checksums, merged
            for text in all_gather_bytes(
                json.dumps(sums).encode() if storage.leader else b"{}", None, device
            ):
                sums.update(json.loads(text))
        if storage.leader:
            try:
                _commit(self.engine, self.step, self.root, gen, self.keep_last, sums, holders, storage)
            except OSError as e:
                error = e
        raise_together(error, None, f"committing ({gen})", device)
        return gen


def begin_save(
    engine: Checkpointable, step: int, root: Path, *, keep_last: int, background: bool
) -> PendingSave:
    """Phase 1 of the module docstring; collective over every rank."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    gen = root / generation_name(step)
    device = engine.mesh.device
    storage = engine.checkpoint_storage(root)
    error: BaseException | None = None
    try:  # a generation of the same step is uncommitted, then removed: a torn save of another
        if storage.leader:  # layout (before a restart on fewer nodes) leaves files this one does not write
            (gen / MANIFEST).unlink(missing_ok=True)
            if gen.exists():
                shutil.rmtree(gen)
    except OSError as e:
        error = e
    raise_together(error, None, f"uncommitting ({gen})", device)
    tensors, metadata = _rank_tensors(engine, step, copy=background)
    rank_rel = f"rank-{engine.mesh.rank:05d}.safetensors"
    writes: list[tuple[str, Write]] = [
        (rank_rel, lambda: write_tensors(gen / rank_rel, tensors, metadata).hex())
    ]
    pending = PendingSave(engine, step, root, gen, keep_last, storage, writes)
    if background:
        pending.shard, shard_bytes = engine.zero.begin_save(zero_dir(engine, gen))
        portable = snapshot_portable(engine, gen, step)
        pending.copied = shard_bytes + sum(t.numel() * t.element_size() for t in tensors.values())
        shard = pending.shard
        if shard.index is not None:
            zero_rel = str((shard.path / shard.meta["files"][shard.index]).relative_to(gen))
            writes.append((zero_rel, lambda: _write_shard(shard)))
        if portable is not None:
            target, write, portable_bytes = portable
            writes.append((str(target.relative_to(gen)), write))
            pending.copied += portable_bytes
        return pending
    zdir = zero_dir(engine, gen)
    engine.zero.save(zdir)  # collective; its meta.json is hashed by rank 0 at the commit
    zero = engine.zero
    zrank = group_rank(zero.group)
    replicated = replicated_checkpoint(zero)  # stage 0, unless expert parameters differ per rank
    mine = rank_file(0, 1) if replicated else rank_file(zrank, zero.world_size)
    if not replicated or zrank == 0:
        writes.append((str((zdir / mine).relative_to(gen)), lambda: sha256(zdir / mine)))
    part = None
    try:
        part = write_portable(engine, gen, step)
    except OSError as e:
        error = e
    raise_together(error, None, f"writing the portable state ({gen})", device)
    if part is not None:
        done = part
        writes.append((str(done.relative_to(gen)), lambda: sha256(done)))
    return pending


def _write_shard(shard: ShardSave) -> str:
    shard.write()
    return shard.digest.hex()


def _local_sums(gen: Path) -> dict[str, str]:
    """The checksums in this folder's copy of ``gen``: the ranks' ``.sha-RRRRR.json`` files it
    holds, and the hash of each ZeRO ``meta.json`` it holds."""
    sums: dict[str, str] = {}
    for part in sorted(gen.glob(".sha-*.json")):
        sums.update(json.loads(part.read_text()))
    for rel in generation_files(gen):
        if rel not in sums and rel.startswith("zero/") and rel.endswith("/meta.json"):
            sums[rel] = sha256(gen / rel)
    return sums


def _commit(
    engine: Checkpointable,
    step: int,
    root: Path,
    gen: Path,
    keep_last: int,
    sums: dict[str, str],
    holders: dict[str, list[int]] | None,
    storage: Storage,
) -> None:
    """Rank 0, or each folder's lowest rank without shared storage: write the manifest of the
    ranks' checksums ``sums`` (the commit), point ``latest``, prune."""
    files = generation_files(gen) if holders is None else sorted(r for r in holders if not r.startswith("."))
    if sorted(sums) != files:
        raise OSError(f"{gen}: the ranks hashed {len(sums)} files, the generation holds {len(files)}")
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "data_position": step,
        **layout(engine),
        "config": fingerprint(engine.config),
        "files": sums,
    }
    if holders is not None:  # which folder (node) holds each file
        manifest["storage"] = {
            "folders": [
                {"host": h, "ranks": list(d)} for h, d in zip(storage.hosts, storage.domains, strict=True)
            ],
            "holders": {rel: holders[rel] for rel in files},
        }
    atomic_write(gen / MANIFEST, json.dumps(manifest, indent=1).encode())
    for part in gen.glob(".sha-*.json"):
        part.unlink()
    atomic_write(root / LATEST, f"{gen.name}\n".encode())
    committed = committed_generations(root)
    for old in committed[:-keep_last]:
        shutil.rmtree(old)
    for torn in sorted(root.glob("step-*")):
        if torn not in committed and torn.name < gen.name:
            shutil.rmtree(torn)


class BackgroundSave:
    """A ``PendingSave`` whose ``write`` runs in a thread of its own from now on; ``finish``
    (the training thread, collective) joins it and commits."""

    def __init__(self, pending: PendingSave) -> None:
        self.pending = pending
        self.generation = pending.generation
        self._thread = threading.Thread(target=self._run, name="tessera-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        self.pending.write()
        log.info("wrote %s in the background in %.2f s", self.generation, time.perf_counter() - started)

    def finish(self) -> Path:
        """Wait for the writer and commit the generation (every rank raises if a writer failed)."""
        self._thread.join()
        return self.pending.commit()
