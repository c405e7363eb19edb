"""Reading and writing one stream of one chunk at a time, wherever the chunk lives: what
checkpoints and the portable state use to move model data through at most a chunk of
memory (a disk chunk's stream is read into, or written from, the caller's buffer). The
caller's buffer may be of another dtype than the chunk's (a frozen chunk's compute dtype):
values are converted on the way, exactly towards fp32.
"""

from __future__ import annotations

from torch import Tensor

from tessera.zero.chunks.chunk import Chunk, Tier
from tessera.zero.chunks.store import ChunkStore

__all__ = [
    "Segment",
    "drop_streams",
    "flat_scalars",
    "flat_streams",
    "read_segment",
    "read_stream",
    "segments",
    "write_segment",
    "write_stream",
]

GRAD = "grad"
MASTER = "master"

Segment = tuple[int, int, Chunk | None]
"""``(lo, hi, chunk)``: elements ``[lo, hi)`` of a FlatParam's shard and the chunk holding them
(None: the FlatParam's own shard holds them, the store holding nothing of it)."""


def segments(store: ChunkStore, flat_index: int) -> list[Segment]:
    """The pieces in which a FlatParam's shard is read and written, in order: its chunks; for a
    FlatParam the store does not hold (frozen, stages 0-2) its shard cut the same way."""
    if store.holds(flat_index):
        return [(c.lo, c.hi, c) for c in store.chunks_of(flat_index)]
    n, step = store.flats[flat_index].layout.shard_numel, store.chunk_numel
    return [(lo, min(lo + step, n), None) for lo in range(0, n, step)]


def read_segment(store: ChunkStore, flat_index: int, segment: Segment, name: str, out: Tensor) -> None:
    """Fill ``out`` (the segment's elements, any device and dtype) with stream ``name``."""
    lo, hi, chunk = segment
    if chunk is None:  # (only its master exists: a frozen FlatParam has no other stream)
        out.copy_(store.flats[flat_index].shard.detach()[lo:hi])
    else:
        read_stream(store, chunk, name, out)


def write_segment(store: ChunkStore, flat_index: int, segment: Segment, name: str, src: Tensor) -> None:
    """Set stream ``name`` of the segment to ``src``; a master is also written into the
    FlatParam's compute shard where the store does not own it."""
    lo, hi, chunk = segment
    if chunk is not None:
        write_stream(store, chunk, name, src)
    if name == MASTER and not store.owns(flat_index):
        store.flats[flat_index].shard.detach()[lo:hi].copy_(src)


def read_stream(store: ChunkStore, chunk: Chunk, name: str, out: Tensor) -> None:
    """Fill ``out`` (``chunk.numel`` elements, any device and dtype) with the chunk's stream
    ``name``."""
    if chunk.tier is Tier.DISK:
        assert store.disk is not None
        if out.device.type == "cpu" and out.is_contiguous() and out.dtype == chunk.dtype:
            store.disk.read_into(chunk.index, name, out)
        else:
            out.copy_(store.disk.read(chunk.index, name, chunk.numel, pin=False, dtype=chunk.dtype))
        return
    out.copy_(chunk.streams[name])


def write_stream(store: ChunkStore, chunk: Chunk, name: str, src: Tensor) -> None:
    """Set the chunk's stream ``name`` to the values of ``src`` (``chunk.numel`` elements),
    keeping no reference to ``src``: a disk chunk writes its file, a resident one copies into
    its tensor (a new one on its tier when it had none), in the chunk's dtype."""
    if chunk.tier is Tier.DISK:
        assert store.disk is not None
        store.disk.write(chunk.index, name, src.detach().to("cpu", chunk.dtype).contiguous())
        chunk.on_disk.add(name)
        return
    held = chunk.streams.get(name)
    if held is not None and held.numel() == chunk.numel:
        held.copy_(src)
    else:
        chunk.streams[name] = store.copy_to(src, chunk.tier, chunk.dtype)


def drop_streams(store: ChunkStore, chunk: Chunk, keep: set[str]) -> None:
    """Forget every stream of the chunk not named in ``keep`` (the gradient included)."""
    for name in [n for n in store.present(chunk) if n not in keep]:
        if name == GRAD:
            store.drop_grads(chunk.flat_index)
            continue
        chunk.streams.pop(name, None)
        if name in chunk.on_disk:
            assert store.disk is not None
            store.disk.drop(chunk.index, name)
            chunk.on_disk.discard(name)


def flat_streams(store: ChunkStore, flat_index: int) -> list[str]:
    """The optimizer state streams a FlatParam's chunks hold (in the store's order; none
    before the first step, nor for a frozen FlatParam), the same for each of its chunks (else
    a RuntimeError)."""
    chunks = store.chunks_of(flat_index)
    if not chunks:  # a frozen FlatParam the store does not hold
        return []
    names = [n for n in store.state_names if n in store.present(chunks[0])]
    for chunk in chunks[1:]:
        mine = [n for n in store.state_names if n in store.present(chunk)]
        if mine != names:
            raise RuntimeError(
                f"chunk {chunk.index} holds the optimizer state {mine}, chunk {chunks[0].index} of the "
                f"same flat buffer {names}"
            )
    return names


def flat_scalars(store: ChunkStore, flat_index: int) -> dict[str, object]:
    """The optimizer's scalar state of a FlatParam (Adam's ``step``): every chunk steps once
    per step, so its first chunk's is every chunk's; a frozen one has none)."""
    chunks = store.chunks_of(flat_index)
    return dict(chunks[0].scalars) if chunks else {}
