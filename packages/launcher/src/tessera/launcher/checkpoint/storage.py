"""Which ranks share a checkpoint folder, and moving a generation's files between those that do not.

A job on several nodes has a shared run folder (a network file system), or one per node: the
same path on every node, on each node's own disk. ``probe_storage`` finds out, by writing a
token per rank and seeing whose tokens each rank can read: ranks that read the same tokens
share a *domain* (one folder). One domain: shared storage, and checkpoints work as on one
node. Several: each rank writes its files into its own domain's folder, and ``spread`` then
copies each file to as many other domains as asked (``REPLICAS`` = 2 at a save, so losing
any one node loses no file), rank to rank over the default process group; a load first
copies into every domain what it lacks of the generation it loads (``gather_generation``).

Every function here is collective over the default process group. Files move between the
lowest ranks of two domains (their *leaders*), one at a time, in the same order on every
rank (`tessera.comm.blobs`).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.comm.blobs import all_gather_bytes, recv_file, send_file
from tessera.comm.consensus import raise_together
from tessera.launcher.checkpoint.generations import (
    MANIFEST,
    committed_generations,
    generation_name,
    read_manifest,
)

__all__ = [
    "PROBE_DIR",
    "REPLICAS",
    "Storage",
    "gather_generation",
    "present_files",
    "probe_storage",
    "spread",
]

log = logging.getLogger(__name__)

PROBE_DIR = ".tessera-storage"
REPLICAS = 2
"""How many domains hold each file of a generation saved without shared storage."""


@dataclass(frozen=True)
class Storage:
    """Who shares the checkpoint folder ``root``: ``domains`` lists the ranks of each folder
    (ordered by their lowest rank), ``mine`` is this rank's, ``hosts`` each domain leader's
    host name."""

    root: Path
    rank: int
    domains: tuple[tuple[int, ...], ...]
    mine: int
    hosts: tuple[str, ...]

    @property
    def shared(self) -> bool:
        """Every rank sees the same folder."""
        return len(self.domains) == 1

    @property
    def leader(self) -> bool:
        """This rank writes what its domain writes once (the manifest, ``latest``)."""
        return self.rank == self.domains[self.mine][0]

    def describe(self) -> str:
        if self.shared:
            return f"{self.root} is shared by all {len(self.domains[0])} ranks"
        parts = " | ".join(
            f"{host}: ranks {_span(ranks)}" for host, ranks in zip(self.hosts, self.domains, strict=True)
        )
        return (
            f"{self.root} is not shared: {len(self.domains)} folders ({parts}); each checkpoint file is "
            f"kept in {min(REPLICAS, len(self.domains))} of them"
        )


def _span(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    return (
        f"{ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) else str(list(ranks))
    )


def probe_storage(root: str | Path, device: torch.device | None = None) -> Storage:
    """Find which ranks share the folder ``root`` (collective; writes and removes one small
    file per rank under ``root/.tessera-storage``)."""
    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    nonce = all_gather_bytes(secrets.token_hex(8).encode() if rank == 0 else b"", None, device)[0].decode()
    probe = root / PROBE_DIR
    token = probe / f"{nonce}-{rank:05d}"
    error: BaseException | None = None
    try:
        probe.mkdir(parents=True, exist_ok=True)
        token.write_text(nonce)
    except OSError as exc:
        error = OSError(f"cannot write in the checkpoint folder {root}: {exc}")
    raise_together(error, None, f"probing the checkpoint folder {root}", device)
    seen = bytes(int((probe / f"{nonce}-{r:05d}").is_file()) for r in range(world))
    views = all_gather_bytes(seen, None, device)
    raise_together(None, None, "probing the checkpoint folder", device)  # every rank has looked
    token.unlink(missing_ok=True)
    groups: dict[bytes, list[int]] = {}
    for r, view in enumerate(views):
        groups.setdefault(view, []).append(r)
    domains = tuple(sorted((tuple(g) for g in groups.values()), key=lambda g: g[0]))
    mine = next(i for i, d in enumerate(domains) if rank in d)
    host = socket.gethostname().encode() if rank == domains[mine][0] else b""
    names = all_gather_bytes(host, None, device)
    storage = Storage(root, rank, domains, mine, tuple(names[d[0]].decode() for d in domains))
    if rank == 0:
        log.info("checkpoint storage: %s", storage.describe())
    return storage


def present_files(generation: Path) -> list[str]:
    """The files of a generation directory on this rank's disk, relative, sorted: the manifest
    and the ranks' checksum files included, files being written (``.*.tmp-*``, ``.*.recv-*``) not."""
    if not generation.is_dir():
        return []
    return sorted(
        str(p.relative_to(generation))
        for p in generation.rglob("*")
        if p.is_file() and not (p.name.startswith(".") and (".tmp-" in p.name or ".recv-" in p.name))
    )


def _holdings(generation: Path, storage: Storage, device: torch.device | None) -> list[set[str]]:
    """The files each domain holds of ``generation`` (its leader looks)."""
    mine = json.dumps(present_files(generation)).encode() if storage.leader else b""
    listed = all_gather_bytes(mine, None, device)
    return [set(json.loads(listed[d[0]])) for d in storage.domains]


def spread(
    generation: Path,
    storage: Storage,
    copies: int,
    device: torch.device | None = None,
    only: Sequence[str] | None = None,
) -> dict[str, list[int]]:
    """Copy each file of ``generation`` (or of ``only``) that fewer than ``copies`` domains hold
    to the next domains after its first holder, in ring order; returns, per file, the domains
    that hold it now. Collective; the bytes move between domain leaders."""
    held = _holdings(generation, storage, device)
    n = len(storage.domains)
    names = sorted(set().union(*held)) if only is None else list(only)  # ``only`` in its order
    holders = {rel: [d for d in range(n) if rel in held[d]] for rel in names}
    moved, error, started = 0, None, time.perf_counter()
    for rel in names:
        have = holders[rel]
        if not have:
            continue
        source = have[0]
        ring = [(source + k) % n for k in range(1, n)]
        for target in [d for d in ring if d not in have][: max(0, min(copies, n) - len(have))]:
            sender, receiver = storage.domains[source][0], storage.domains[target][0]
            try:
                if storage.rank == sender:
                    moved += send_file(generation / rel, receiver)
                elif storage.rank == receiver:
                    moved += recv_file(generation / rel, sender)
            except OSError as exc:  # the pair's other side then fails too; both name the file
                error = error or OSError(f"copying {generation / rel} between nodes: {exc}")
            have.append(target)
    raise_together(error, None, f"copying {generation} between nodes", device)
    if moved:
        seconds = time.perf_counter() - started
        log.info(
            "copied %.2f MiB of %s between checkpoint folders in %.3f s",
            moved / 2**20,
            generation.name,
            seconds,
        )
    return holders


def gather_generation(
    root: Path, storage: Storage, step: int | None, device: torch.device | None = None
) -> Path:
    """The newest generation under ``root`` (or the one of ``step``) committed in some domain
    whose every file some domain holds, copied whole into every domain's folder first; the
    generation directory. Collective. ValueError (on every rank) if there is none."""
    mine = [int(read_manifest(g)["step"]) for g in committed_generations(root)] if storage.leader else []
    lists = all_gather_bytes(json.dumps(mine).encode(), None, device)
    committed: dict[int, int] = {}  # step -> the first domain that committed it
    for d, ranks in enumerate(storage.domains):
        for s in json.loads(lists[ranks[0]]):
            committed.setdefault(int(s), d)
    candidates = sorted(committed, reverse=True) if step is None else [s for s in committed if s == step]
    for s in candidates:
        gen = root / generation_name(s)
        owner = storage.domains[committed[s]][0]
        text = b""
        if storage.rank == owner:
            try:
                text = json.dumps(sorted(read_manifest(gen)["files"])).encode()
            except (OSError, ValueError, KeyError) as exc:
                log.warning("generation %s cannot be read: %s", gen.name, exc)
        listed = all_gather_bytes(text, None, device)[owner]
        if not listed:
            continue
        files = [*json.loads(listed), MANIFEST]  # the manifest last: a folder that has it has the rest
        held = _holdings(gen, storage, device)
        if all(any(rel in h for h in held) for rel in files):
            spread(gen, storage, len(storage.domains), device, only=files)
            return gen
        lost = next(rel for rel in files if not any(rel in h for h in held))
        log.warning("generation %s cannot be loaded: no node holds %s", gen.name, lost)
    which = "no committed generation" if step is None else f"no generation of step {step}"
    raise ValueError(f"{root} holds {which} whose files the nodes have between them (step-*/{MANIFEST})")
