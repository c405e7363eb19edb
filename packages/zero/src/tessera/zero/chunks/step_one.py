"""One chunk through the torch optimizer: the placeholder parameter is pointed at the chunk's
streams (data: the master; ``grad``: the gradient, times the step's factor; state: the state
streams and the given scalars), the optimizer steps that one parameter, and the new state
comes back. Used by the step of every chunk at ``step()`` (``step.py``) and by the disk chunks
stepped as their gradient arrives (``early.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from tessera.zero.chunks.chunk import Chunk

__all__ = ["emptied_groups", "step_chunk"]


@contextlib.contextmanager
def emptied_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Empty every parameter group for the block (``step_chunk`` puts one placeholder in its
    group at a time) and give them back their placeholders after it."""
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = []
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


def step_chunk(
    optimizer: torch.optim.Optimizer,
    state_names: Sequence[str],
    chunk: Chunk,
    streams: dict[str, Tensor],
    factor: float,
    scalars: dict[str, object],
) -> dict[str, object]:
    """Step ``chunk`` (inside ``emptied_groups``): ``streams`` holds its master, gradient and
    state streams and is updated in place (the gradient multiplied by ``factor``, new state
    streams added); returns its new scalar state, from ``scalars`` (which the optimizer may
    update in place: Adam's ``step`` tensor)."""
    if "grad" not in streams:
        raise RuntimeError(f"chunk {chunk.index} has no gradient; call backward first")
    grad = streams["grad"]
    if factor != 1.0:
        grad.mul_(factor)
    p = chunk.param
    p.data = streams["master"]
    p.grad = grad
    state = optimizer.state[p]
    state.update(scalars)
    state.update({n: streams[n] for n in state_names if n in streams})
    group = optimizer.param_groups[chunk.group_index]
    group["params"] = [p]
    try:
        optimizer.step()
    finally:
        group["params"] = []
        p.grad = None
        p.data = torch.empty(0, device=p.device)
    out: dict[str, object] = {}
    for name, value in optimizer.state.pop(p, {}).items():
        if name in state_names and isinstance(value, Tensor):
            streams[name] = value
        else:
            out[name] = value
    return out
