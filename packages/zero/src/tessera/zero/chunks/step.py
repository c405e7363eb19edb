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
from torch import Tensor

from tessera.comm import Group
from tessera.zero.chunks.chunk import Chunk
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
    the gradients."""
    optimizer = store.optimizer
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = []
    try:
        with torch.no_grad():
            for chunk, streams in store.iterate(store.present):
                _step_one(store, chunk, streams, factor)
                if not store.owns(chunk.flat_index):
                    flat = flats[chunk.flat_index]
                    flat.shard.detach()[chunk.lo : chunk.hi].copy_(streams["master"])
                grad = streams.pop("grad")
                del grad
                store.write_back(chunk, streams)
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


def _step_one(store: ChunkStore, chunk: Chunk, streams: dict[str, Tensor], factor: float) -> None:
    optimizer = store.optimizer
    if "grad" not in streams:
        raise RuntimeError(f"chunk {chunk.index} has no gradient; call backward first")
    grad = streams["grad"]
    if factor != 1.0:
        grad.mul_(factor)
    p = chunk.param
    p.data = streams["master"]
    p.grad = grad
    state = optimizer.state[p]
    state.update(chunk.scalars)
    state.update({n: streams[n] for n in store.state_names if n in streams})
    group = optimizer.param_groups[chunk.group_index]
    group["params"] = [p]
    try:
        optimizer.step()
    finally:
        group["params"] = []
        p.grad = None
        p.data = torch.empty(0, device=p.device)
    for name, value in optimizer.state.pop(p, {}).items():
        if name in store.state_names and isinstance(value, Tensor):
            streams[name] = value
        else:
            chunk.scalars[name] = value
