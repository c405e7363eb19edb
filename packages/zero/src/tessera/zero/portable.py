"""ZeRO state by parameter name, independent of how it is sharded: the basis of checkpoints
that load under another world size or stage.

``full_state`` gathers, for every parameter, its fp32 master and each elementwise optimizer
state tensor (Adam's moments, SGD's momentum) in full, and each optimizer group's scalar
state (Adam's ``step``); ``load_full_state`` takes the same dictionary and keeps this rank's
shard of every flat buffer, whatever the stage and world size that produced it. Keys:
``param/<name>``, ``optim.<key>/<name>`` and ``optim.<key>/group<i>``. Elementwise
optimizers only, as everywhere in ZeRO: a state tensor is either shaped like the master
shard or a 0-dim scalar.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from tessera.zero.flat_param import FlatParam

__all__ = ["PortableZero", "full_state", "load_full_state"]


class PortableZero(Protocol):
    """What the portable state reads and writes (a ``ZeroOptimizer`` is one)."""

    @property
    def flats(self) -> Sequence[FlatParam]: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


def _sources(zero: PortableZero, flat: FlatParam) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The flat's shards by kind (``param``, ``optim.<key>``) and its scalar state."""
    shards = {"param": flat.master.detach()}
    scalars: dict[str, Tensor] = {}
    for key, value in zero.optimizer.state.get(flat.master, {}).items():
        if isinstance(value, Tensor) and value.shape == flat.master.shape:
            shards[f"optim.{key}"] = value.detach()
        elif isinstance(value, Tensor) and value.dim() == 0:
            scalars[f"optim.{key}/group{flat.group_index}"] = value.detach().to("cpu", copy=True)
        else:
            raise TypeError(
                f"optimizer state {key!r} of {type(zero.optimizer).__name__} is neither elementwise nor a "
                f"scalar ({type(value).__name__}); it cannot be resharded"
            )
    return shards, scalars


def full_state(zero: PortableZero) -> dict[str, Tensor]:
    """Every parameter's master and optimizer state in full fp32 on the host, by name, and the
    scalar state per group (collective over the group: all-gathers, unless replicated)."""
    out: dict[str, Tensor] = {}
    for flat in zero.flats:
        shards, scalars = _sources(zero, flat)
        out.update(scalars)
        for kind, shard in shards.items():
            full = flat.gather_full(shard)
            for i, name in enumerate(flat.names):
                start, stop = flat.layout.span(i)
                value = full[start:stop].view(flat.params[i].shape)
                out[f"{kind}/{name}"] = value.to("cpu", torch.float32, copy=True)
    return out


def _shard(flat: FlatParam, kind: str, state: Mapping[str, Tensor]) -> Tensor:
    """This rank's shard of ``kind`` for ``flat``, cut from the full tensors in ``state``."""
    buf = torch.zeros(flat.layout.padded_numel, dtype=torch.float32)
    for i, name in enumerate(flat.names):
        key = f"{kind}/{name}"
        if key not in state:
            raise KeyError(f"the state to load lacks {key!r}")
        start, stop = flat.layout.span(i)
        value = state[key]
        if value.numel() != stop - start:
            raise ValueError(f"{key} has {value.numel()} elements, the parameter {stop - start}")
        buf[start:stop] = value.reshape(-1)
    lo, hi = flat.layout.shard_range(flat.shard_rank)
    return buf[lo:hi]


def load_full_state(zero: PortableZero, state: Mapping[str, Tensor]) -> None:
    """Set every master and the optimizer state from ``state`` (as ``full_state`` returns it,
    from any stage and world size). Local; the owner then pushes the masters into the
    parameters (``ZeroOptimizer.load_full_state`` does)."""
    kinds = sorted({k.split("/", 1)[0] for k in state if k.startswith("optim.") and "/group" not in k})
    for flat in zero.flats:
        master = flat.master
        with torch.no_grad():
            master.copy_(_shard(flat, "param", state))
        entry: dict[str, Any] = {}
        for kind in kinds:
            entry[kind.removeprefix("optim.")] = _shard(flat, kind, state).to(master.device, copy=True)
        for key, value in state.items():
            kind, _, where = key.partition("/")
            if where == f"group{flat.group_index}":
                entry[kind.removeprefix("optim.")] = value.clone()
        if entry:
            zero.optimizer.state[master] = entry
        else:
            zero.optimizer.state.pop(master, None)
