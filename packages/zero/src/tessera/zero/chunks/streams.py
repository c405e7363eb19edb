"""Reading and writing one stream of one chunk at a time, wherever the chunk lives: what
checkpoints and the portable state use to move model data through at most a chunk of
memory (a disk chunk's stream is read into, or written from, the caller's buffer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tessera.zero.chunks.chunk import Chunk, Tier
from tessera.zero.chunks.store import ChunkStore

__all__ = ["drop_streams", "flat_scalars", "flat_streams", "read_stream", "write_stream"]

GRAD = "grad"
MASTER = "master"


def read_stream(store: ChunkStore, chunk: Chunk, name: str, out: Tensor) -> None:
    """Fill ``out`` (``chunk.numel`` elements, any device) with the chunk's stream ``name``."""
    if chunk.tier is Tier.DISK:
        assert store.disk is not None
        if out.device.type == "cpu" and out.is_contiguous() and out.dtype == torch.float32:
            store.disk.read_into(chunk.index, name, out)
        else:
            out.copy_(store.disk.read(chunk.index, name, chunk.numel, pin=False))
        return
    out.copy_(chunk.streams[name])


def write_stream(store: ChunkStore, chunk: Chunk, name: str, src: Tensor) -> None:
    """Set the chunk's stream ``name`` to the values of ``src`` (``chunk.numel`` elements),
    keeping no reference to ``src``: a disk chunk writes its file, a resident one copies into
    its tensor (a new one on its tier when it had none)."""
    if chunk.tier is Tier.DISK:
        assert store.disk is not None
        store.disk.write(chunk.index, name, src.detach().cpu().contiguous())
        chunk.on_disk.add(name)
        return
    held = chunk.streams.get(name)
    if held is not None and held.numel() == chunk.numel:
        held.copy_(src)
    else:
        chunk.streams[name] = store._copy_to(src, chunk.tier)


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
    before the first step), the same for each of its chunks (else a RuntimeError)."""
    chunks = store.chunks_of(flat_index)
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
    per step, so its first chunk's is every chunk's."""
    return dict(store.chunks_of(flat_index)[0].scalars)
