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

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.comm.safefile import SafeFile
from tessera.launcher.config import Config
from tessera.launcher.generations import (
    FORMAT,
    LATEST,
    MANIFEST,
    committed_generations,
    generation_name,
    read_manifest,
    resolve_generation,
)
from tessera.launcher.placement import Boosted
from tessera.launcher.reshard import PORTABLE, load_portable_state, read_portable, write_portable

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Checkpointable",
    "committed_generations",
    "load_engine",
    "resolve_generation",
    "save_engine",
]

log = logging.getLogger(__name__)

_READ_ERRORS = (OSError, ValueError, KeyError, json.JSONDecodeError, safetensors.SafetensorError)


class Checkpointable(Boosted, Protocol):
    """What a checkpoint reads from and restores into (an ``Engine`` is one)."""

    @property
    def scheduler(self) -> Any: ...
    @property
    def config(self) -> Config: ...


# ---------------------------------------------------------------------------- pure parts
# Fields that choose where or how the state lives but not what it is: a resume may change them
# (a chunked run's checkpoint loads unchunked, under another disk directory or budget; the
# split tuning only orders the halves of each backward).
_PLACEMENT_ONLY = {
    "parallel": ("auto", "cluster", "tune_splits"),
    "zero": ("host_budget_mb", "device_budget_mb", "disk_dir", "policy", "fractions", "chunk_numel"),
}


def _fingerprint(config: Config) -> dict[str, Any]:
    """The configuration that shapes the saved state: a resume under another one is refused."""
    out = {name: dataclasses.asdict(getattr(config, name)) for name in ("parallel", "zero", "model", "optim")}
    for section, names in _PLACEMENT_ONLY.items():
        for name in names:
            out[section].pop(name, None)
    out["data"] = {"corpus": config.data.corpus, "batch_size": config.data.batch_size}
    if config.data.path:  # the user's own data: its samples are what the data position counts
        out["data"].update(path=config.data.path, tokenizer=config.data.tokenizer)
    out["train"] = {"seed": config.train.seed, "precision": config.train.precision}
    return out


def _differences(saved: dict[str, Any], mine: dict[str, Any], prefix: str = "") -> list[str]:
    """What differs, for the keys this run's fingerprint has (a key only an older checkpoint
    recorded, such as ``parallel.auto``, no longer shapes the state)."""
    lines = []
    for key in sorted(mine):
        a, b = saved.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: saved {a!r}, now {b!r}")
    return lines


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(generation: Path) -> list[str]:
    """Every file of a generation but the manifest and hidden staging files, relative, sorted."""
    return sorted(
        str(p.relative_to(generation))
        for p in generation.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )


# ---------------------------------------------------------------------------- save
def _layout(engine: Checkpointable) -> dict[str, Any]:
    t = engine.mesh.topology
    return {
        "world_size": t.world_size,
        "topology": {
            "dp": t.dp,
            "pp": t.pp,
            "tp": t.tp,
            "sp": t.sp,
            "tp_mode": str(t.tp_mode),
            "depth": t.depth,
        },
        "stage_to_rank": list(engine.placement.stage_to_rank),
        "zero_stage": engine.zero.stage,
    }


def _rank_bytes(engine: Checkpointable, step: int) -> bytes:
    module = engine.module  # under ZeRO-3 the parameters live in the ZeRO shards: keep the buffers
    state = dict(module.named_buffers()) if engine.zero.stage == 3 else module.state_dict()
    tensors = {f"module.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    scheduler = engine.scheduler.state_dict() if engine.scheduler is not None else None
    header = {"step": step, "scheduler": scheduler}
    return safetensors.torch.save(tensors, metadata={"tessera": json.dumps(header)})


def _zero_dir(engine: Checkpointable, generation: Path) -> Path:
    return generation / "zero" / f"pp-{engine.mesh.coordinate('pp')}-tp-{engine.mesh.coordinate('tp')}"


def save_engine(engine: Checkpointable, step: int, root: str | Path, *, keep_last: int = 2) -> Path:
    """Write a new generation of the engine's training state under ``root`` and commit it;
    returns its directory. Collective over every rank."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    gen = root / generation_name(step)
    rank, world, device = engine.mesh.rank, engine.mesh.topology.world_size, engine.mesh.device

    def together(what: str, fn: Callable[[], None], *, only_rank_0: bool = False) -> None:
        error = None
        try:
            if rank == 0 or not only_rank_0:
                fn()
        except OSError as e:
            error = e
        raise_together(error, None, f"{what} ({gen})", device)

    def uncommit() -> None:  # a generation of the same step, before rewriting any of its files
        (gen / MANIFEST).unlink(missing_ok=True)

    def write_rank_file() -> None:
        atomic_write(gen / f"rank-{rank:05d}.safetensors", _rank_bytes(engine, step))

    def hash_share() -> None:
        sums = {f: _sha256(gen / f) for f in files[rank::world]}
        atomic_write(gen / f".sha-{rank:05d}.json", json.dumps(sums).encode())

    together("uncommitting", uncommit, only_rank_0=True)
    engine.zero.save(_zero_dir(engine, gen))
    together("writing the rank file", write_rank_file)
    together("writing the portable state", lambda: write_portable(engine, gen, step))
    files = _files(gen)
    together("hashing", hash_share)
    together("committing", lambda: _commit(engine, step, root, gen, files, keep_last), only_rank_0=True)
    return gen


def _commit(
    engine: Checkpointable, step: int, root: Path, gen: Path, files: list[str], keep_last: int
) -> None:
    """Rank 0: merge the ranks' checksums into the manifest (the commit), point ``latest``, prune."""
    sums: dict[str, str] = {}
    world = engine.mesh.topology.world_size
    for r in range(world):
        part = gen / f".sha-{r:05d}.json"
        sums.update(json.loads(part.read_text()))
        part.unlink()
    if sorted(sums) != files:
        raise OSError(f"{gen}: the ranks hashed {len(sums)} files, the generation holds {len(files)}")
    manifest = {
        "format": FORMAT,
        "step": step,
        "data_position": step,
        **_layout(engine),
        "config": _fingerprint(engine.config),
        "files": sums,
    }
    atomic_write(gen / MANIFEST, json.dumps(manifest, indent=1).encode())
    atomic_write(root / LATEST, f"{gen.name}\n".encode())
    committed = committed_generations(root)
    for old in committed[:-keep_last]:
        shutil.rmtree(old)
    for torn in sorted(root.glob("step-*")):
        if torn not in committed and torn.name < gen.name:
            shutil.rmtree(torn)


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
        if (own_sum if rel == own.name else _sha256(gen / rel)) != manifest["files"][rel]:
            raise ValueError(f"{gen / rel} does not match its checksum in {MANIFEST}")
    if own.name not in share and own_sum != manifest["files"].get(own.name):
        raise ValueError(f"{own} does not match its checksum in {MANIFEST}")
    header: dict[str, Any] = json.loads(SafeFile(own, data).metadata["tessera"])
    if header["step"] != manifest["step"]:
        raise ValueError(f"{gen / MANIFEST} says step {manifest['step']}, {own.name} step {header['step']}")
    return gen, manifest, safetensors.torch.load(data), header


def _same_layout(engine: Checkpointable, manifest: dict[str, Any]) -> bool:
    mine = _layout(engine)
    return {k: manifest.get(k) for k in mine} == mine


def _check_portable(
    engine: Checkpointable, gen: Path, manifest: dict[str, Any]
) -> tuple[Path, dict[str, Any], Mapping[str, Tensor], dict[str, Any]]:
    """The checks of a generation saved under another topology: the configuration but its
    parallel and zero sections, and the checksums of the portable parts every rank reads."""
    ignored = ("parallel", "zero")
    saved = {k: v for k, v in manifest["config"].items() if k not in ignored}
    mine = {k: v for k, v in _fingerprint(engine.config).items() if k not in ignored}
    changed = _differences(saved, mine)
    if changed:
        raise ValueError(f"{gen} was saved under another configuration: {'; '.join(changed[:6])}")
    for rel, digest in manifest["files"].items():
        if rel.startswith(PORTABLE + "/") and _sha256(gen / rel) != digest:
            raise ValueError(f"{gen / rel} does not match its checksum in {MANIFEST}")
    state, header = read_portable(gen, int(manifest["topology"]["pp"]))
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
    error: BaseException | None = None
    same = True
    try:
        gen = resolve_generation(path)
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
    engine.zero.load(_zero_dir(engine, gen))
    if engine.scheduler is not None and header["scheduler"] is not None:
        engine.scheduler.load_state_dict(header["scheduler"])
    raise_together(None, None, "loading", device)  # every rank has loaded before anyone goes on
    return int(manifest["step"]), gen
