"""The optimizer step, chunk by chunk, where each chunk lives (frozen chunks are skipped: they
have no gradient, and nothing is written back to them).

The torch optimizer's parameter groups hold one placeholder parameter per chunk. For each
chunk in use order, its streams are brought to where it computes (device and host chunks
step in place; disk chunks in host staging buffers, the next one read ahead meanwhile),
the placeholder is pointed at them (data: the master; ``grad``: the gradient, scaled by the
unscale/average/clip factor; optimizer state: the state streams and the kept scalars), the
optimizer steps that one parameter, and the results go back to the chunk's tier. Every
element goes through the same elementwise arithmetic as when the optimizer steps the whole
shard at once, so the result is the same, bit for bit, whatever the chunk size or tier.

Optimizer step hooks run once per chunk.
"""

from __future__ import annotations

import torch

from tessera.comm import Group
from tessera.zero.chunks.step_one import emptied_groups, step_chunk
from tessera.zero.chunks.store import ChunkStore
from tessera.zero.clip import GradStats, reduce_grad_stats
from tessera.zero.flat_param import FlatParam

__all__ = ["chunk_grad_stats", "step_chunks"]


def chunk_grad_stats(
    store: ChunkStore,
    group: Group,
    device: torch.device,
    *,
    extra_groups: tuple[Group, ...] = (),
    replicated: bool = False,
) -> GradStats:
    """The global gradient norm and overflow flag, from the squared norms the chunks computed
    as their gradients arrived (one all-reduce of 32 bytes per group, as ``global_grad_stats``)."""
    store.end_warmup()
    sq, bad = store.grad_sq()
    return reduce_grad_stats(sq, bad, group, device, extra_groups=extra_groups, replicated=replicated)


def step_chunks(store: ChunkStore, flats: list[FlatParam], factor: float) -> None:
    """Step the optimizer over every chunk (gradients times ``factor`` first), write the
    masters into the FlatParams' compute shards where those are separate copies, and drop
    the gradients. Chunks already stepped during backward (``early.py``) are committed."""
    if store.early is not None and store.early.pending and store.early.factor != factor:
        raise RuntimeError(
            f"chunks {sorted(store.early.pending)[:5]} stepped in backward with the factor "
            f"{store.early.factor}, but the step's factor is {factor}"
        )
    early = store.early.commit() if store.early is not None else set()
    optimizer = store.optimizer
    with torch.no_grad(), emptied_groups(optimizer):
        for chunk, streams in store.iterate(store.present, skip=early):
            chunk.scalars = step_chunk(optimizer, store.state_names, chunk, streams, factor, chunk.scalars)
            if not store.owns(chunk.flat_index):
                flat = flats[chunk.flat_index]
                flat.shard.detach()[chunk.lo : chunk.hi].copy_(streams["master"])
            grad = streams.pop("grad")
            del grad
            store.write_back(chunk, streams)
