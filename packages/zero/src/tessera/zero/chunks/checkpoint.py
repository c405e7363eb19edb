"""Sharded checkpoints of the chunk memory manager, written and read one chunk at a time.

The format is the flat ZeRO checkpoint's (``tessera.zero.checkpoint``: ``meta.json`` plus a
safetensors file per rank, same tensor names, same checks): ``master.<i>`` is FlatParam
``i``'s fp32 master shard (a frozen one's compute-dtype values; a checkpoint that holds
them in fp32, as older ones do, loads too), ``optim.<j>.<key>`` its optimizer state (``j``:
the index its master would have in ``optimizer.state_dict()`` without chunks),
``group.<g>.<key>`` tensor hyperparameters, ``buffer.<name>`` the model's buffers, and the
rest as JSON in the header.
So a checkpoint saved with chunks loads without them and the other way round, at the same
world size, stage and layout; the chunk size and the placement do not matter.

What differs is how the bytes move. ``rank_writer`` knows every tensor's size up front,
writes the safetensors header first and then each shard stream chunk by chunk, in file
order, hashing as it goes: a resident chunk's stream is written from its own tensor, a disk
chunk's is read into one staging buffer of a chunk (its CRC-32 checked) and written from
there, so a save needs one chunk of extra memory whatever the model's size. ``rank_opener``
checks the file's sha256 in blocks of 1 MiB and its header against this optimizer's
layout (names, dtypes, shapes) before the ranks agree, then reads each chunk's element
range of each stream into the staging buffer and stores it on the chunk's tier.
``rank_snapshot`` copies the same tensors to host memory at once (a background save's
snapshot: the whole rank's state) and writes them later.
Gradients are not saved (as without chunks); streams the checkpoint does not hold (optimizer
state saved before the first step) are dropped from the chunks. A frozen FlatParam the store
does not hold (stages 0-2) is written from, and read into, its own shard, in pieces of a
chunk (``tessera.zero.chunks.streams.segments``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tessera.comm.safefile import Entry, SafeFile, StreamWriter, sha256_file, tensor_bytes
from tessera.zero.checkpoint import (
    HEADER_KEY,
    Checkpointable,
    RankOpener,
    RankWriter,
    buffers_payload,
    check_master_dtype,
    groups_payload,
    json_ready,
    load_groups,
    optimizer_index,
    write_tensors,
)
from tessera.zero.chunks.chunk import Tier
from tessera.zero.chunks.store import ChunkStore
from tessera.zero.chunks.streams import (
    MASTER,
    drop_streams,
    flat_scalars,
    flat_streams,
    read_segment,
    segments,
    write_segment,
)

__all__ = ["rank_opener", "rank_snapshot", "rank_writer"]

_F32 = torch.float32


def _key(index: list[int], fi: int, stream: str) -> str:
    return f"master.{fi}" if stream == MASTER else f"optim.{index[fi]}.{stream}"


def _dtype(store: ChunkStore, fi: int, stream: str) -> torch.dtype:
    return store.master_dtype(fi) if stream == MASTER else _F32


def _staging(store: ChunkStore) -> Tensor:
    """Host bytes for one chunk of any stream (``_view`` takes a dtype's elements from it)."""
    return torch.empty(store.chunk_numel * _F32.itemsize, dtype=torch.uint8)


def _view(staging: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    return staging[: numel * dtype.itemsize].view(dtype)


def _pieces(store: ChunkStore, fi: int, stream: str, staging: Tensor) -> Iterator[memoryview]:
    """The bytes of FlatParam ``fi``'s shard stream, chunk by chunk."""
    for segment in segments(store, fi):
        lo, hi, chunk = segment
        if chunk is not None and chunk.tier is Tier.HOST:
            yield tensor_bytes(chunk.streams[stream])
        else:  # disk: read (CRC checked); device: copied to the host; the FlatParam's shard
            buf = _view(staging, hi - lo, _dtype(store, fi, stream))
            read_segment(store, fi, segment, stream, buf)
            yield tensor_bytes(buf)


def _plan(
    zero: Checkpointable, store: ChunkStore
) -> tuple[list[tuple[int, str]], list[Entry], dict[str, Tensor], dict[str, str]]:
    """The shard streams in file order, every entry, the small tensors and the header."""
    index = optimizer_index(zero)
    streams = [[MASTER] for _ in store.flats]
    for fi in range(len(store.flats)):
        streams[fi] += flat_streams(store, fi)
    small: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for fi in range(len(store.flats)):
        for key, value in flat_scalars(store, fi).items():
            if isinstance(value, Tensor):
                small[f"optim.{index[fi]}.{key}"] = value.detach().to("cpu", copy=True)
            else:
                state.setdefault(str(index[fi]), {})[key] = json_ready(value, f"optimizer state {key}")
    group_tensors, groups = groups_payload(zero.optimizer)
    small.update(group_tensors)
    small.update(buffers_payload(zero.model))
    big = [
        (fi, s) for s in ["master", *store.state_names] for fi in range(len(store.flats)) if s in streams[fi]
    ]
    entries = [
        Entry(_key(index, fi, s), _dtype(store, fi, s), (store.flats[fi].layout.shard_numel,))
        for fi, s in big
    ]
    entries += [Entry(name, t.dtype, tuple(t.shape)) for name, t in small.items()]
    metadata = {HEADER_KEY: json.dumps({"state": state, "param_groups": groups})}
    return big, entries, small, metadata


def rank_writer(zero: Checkpointable, store: ChunkStore) -> RankWriter:
    """What writes this rank's checkpoint file from the chunks (module docstring)."""

    def write(target: Path) -> bytes:
        big, entries, small, metadata = _plan(zero, store)
        staging = _staging(store)
        with StreamWriter(target, entries, metadata) as out, torch.no_grad():
            for fi, stream in big:
                for piece in _pieces(store, fi, stream, staging):
                    out.write(piece)
            for tensor in small.values():
                out.write(tensor_bytes(tensor))
            return out.commit()

    return write


def rank_snapshot(zero: Checkpointable, store: ChunkStore) -> tuple[RankWriter, int]:
    """Copy this rank's checkpoint tensors from the chunks (every tier) to host memory now;
    what writes that copy later, from any thread, and the bytes copied. The copy is the whole
    rank's state: with a disk tier, more than the host budget holds."""
    big, entries, small, metadata = _plan(zero, store)
    tensors: dict[str, Tensor] = {}
    index = optimizer_index(zero)
    with torch.no_grad():
        for fi, stream in big:
            shard = torch.empty(store.flats[fi].layout.shard_numel, dtype=_dtype(store, fi, stream))
            for segment in segments(store, fi):
                read_segment(store, fi, segment, stream, shard[segment[0] : segment[1]])
            tensors[_key(index, fi, stream)] = shard
    tensors.update(small)
    assert [e.name for e in entries] == list(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return (lambda target: write_tensors(target, tensors, metadata)), nbytes


def rank_opener(zero: Checkpointable, store: ChunkStore) -> RankOpener:
    """What checks this rank's checkpoint file and then loads it into the chunks."""

    def open_rank(file: Path, sha256: str) -> Callable[[], None]:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: the checkpoint is incomplete")
        got = sha256_file(file)
        if got != sha256:
            raise ValueError(f"{file}: checksum mismatch (the file changed after it was saved)")
        safe = SafeFile(file)
        extra: dict[str, Any] = json.loads(safe.metadata.get(HEADER_KEY, "null")) or {}
        if not isinstance(extra.get("state"), dict) or not isinstance(extra.get("param_groups"), list):
            raise ValueError(f"{file}: its header lacks the optimizer's state and groups ({HEADER_KEY!r})")
        index = optimizer_index(zero)
        streams: list[list[str]] = []
        scalars: list[dict[str, object]] = []
        with open(file, "rb") as f:
            for fi, flat in enumerate(store.flats):
                shape = (flat.layout.shard_numel,)
                saved = safe.entry(_key(index, fi, MASTER), None, shape)
                check_master_dtype(flat, fi, saved.dtype, file)
                mine, kept = [MASTER], dict(extra["state"].get(str(index[fi]), {}))
                prefix = f"optim.{index[fi]}."
                for name in [n for n in safe.entries if n.startswith(prefix)]:
                    key, entry = name.removeprefix(prefix), safe.entries[name]
                    if key in store.state_names:
                        safe.entry(name, _F32, shape)
                        mine.append(key)
                    elif entry.shape == ():
                        kept[key] = safe.read(f, name)
                    else:
                        raise ValueError(
                            f"{file}: {name} is {list(entry.shape)}, neither a state stream "
                            f"({', '.join(store.state_names)}) of {shape[0]} elements nor a scalar"
                        )
                streams.append(mine)
                scalars.append(kept)
            small = {n: safe.read(f, n) for n in safe.entries if n.startswith(("group.", "buffer."))}
        for name, _ in zero.model.named_buffers():
            if f"buffer.{name}" not in small:
                raise ValueError(f"{file} lacks the model buffer {name!r}")
        return lambda: _apply(zero, store, safe, streams, scalars, small, extra)

    return open_rank


def _apply(
    zero: Checkpointable,
    store: ChunkStore,
    safe: SafeFile,
    streams: list[list[str]],
    scalars: list[dict[str, object]],
    small: dict[str, Tensor],
    extra: dict[str, Any],
) -> None:
    index = optimizer_index(zero)
    staging = _staging(store)
    with open(safe.path, "rb") as f, torch.no_grad():
        for fi in range(len(store.flats)):
            for segment in segments(store, fi):
                lo, hi, chunk = segment
                for stream in streams[fi]:
                    key = _key(index, fi, stream)  # read in the file's dtype, stored in the chunk's
                    buf = _view(staging, hi - lo, safe.entries[key].dtype)
                    safe.read_into(f, key, buf, lo)
                    write_segment(store, fi, segment, stream, buf)
                if chunk is not None:
                    drop_streams(store, chunk, set(streams[fi]))
                    chunk.scalars = {
                        k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars[fi].items()
                    }
        for name, buffer in zero.model.named_buffers():
            buffer.copy_(small[f"buffer.{name}"])
    load_groups(zero.optimizer, extra["param_groups"], small, {})
