"""ZeRO state by parameter name, independent of how it is sharded: the basis of checkpoints
that load under another world size or stage, streamed one parameter at a time.

``iter_full_state`` yields, for every parameter, its fp32 master and each elementwise
optimizer state tensor (Adam's moments, SGD's momentum) in full, and each optimizer group's
scalar state (Adam's ``step``), as ``(key, tensor)``: fp32 on the host, one at a time, in the
same order on every rank (it is collective: each FlatParam's shard of one kind is
all-gathered, so a rank holds at most one flat buffer of one kind at a time).
``full_state_layout`` lists the keys and shapes it will yield, without communicating.
``load_full_state`` takes such a mapping and keeps this rank's shard of every flat buffer,
whatever the stage and world size that produced it, reading the mapping one parameter at a
time (``state[key]``, ``key in state`` and ``state.keys()`` only, so a lazy mapping over a
file never loads it whole). With the chunk memory manager the shards are read from, and
written to, the chunks one chunk at a time.

Keys: ``param/<name>``, ``optim.<key>/<name>`` and ``optim.<key>/group<i>`` (each group's
scalars once, at its first FlatParam). Elementwise optimizers only, as everywhere in ZeRO: a
state tensor is either shaped like the master shard or a 0-dim scalar. Optimizer state
exists only once the optimizer has stepped: before the first step the layout and the state
hold the ``param/`` keys alone, and loading such a state leaves the optimizer fresh. A frozen
parameter (never stepped) has its ``param/`` key alone, and its value is the compute-dtype
value it keeps instead of an fp32 master (given in fp32, exactly; loading rounds a value to
the compute dtype, as building the optimizer rounded the model's own).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

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
from tessera.zero.flat_param import FlatParam

__all__ = ["PortableZero", "full_state", "full_state_layout", "iter_full_state", "load_full_state"]

Layout = list[tuple[str, tuple[int, ...]]]


class PortableZero(Protocol):
    """What the portable state reads and writes (a ``ZeroOptimizer`` is one)."""

    @property
    def flats(self) -> Sequence[FlatParam]: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


def _kinds_and_scalars(
    zero: PortableZero, store: ChunkStore | None, fi: int
) -> tuple[list[str], dict[str, Tensor]]:
    """FlatParam ``fi``'s kinds (``param``, then ``optim.<key>`` by name) and its scalar state
    by key (by name). The order is the names', never the order the optimizer's state dict was
    filled in: that differs between ranks after a load, and each kind is one collective."""
    flat = zero.flats[fi]
    if store is not None:
        streams = flat_streams(store, fi)
        items: list[tuple[str, object]] = list(flat_scalars(store, fi).items())
    else:
        streams, items = [], []
        for key, value in zero.optimizer.state.get(flat.master, {}).items():
            if isinstance(value, Tensor) and value.shape == flat.master.shape:
                streams.append(key)
            else:
                items.append((key, value))
    kinds = ["param"] + [f"optim.{n}" for n in sorted(streams)]
    items.sort(key=lambda item: item[0])
    scalars: dict[str, Tensor] = {}
    for key, value in items:
        if not (isinstance(value, Tensor) and value.dim() == 0):
            raise TypeError(
                f"optimizer state {key!r} of {type(zero.optimizer).__name__} is neither elementwise nor a "
                f"scalar ({type(value).__name__}); it cannot be resharded"
            )
        scalars[f"optim.{key}/group{flat.group_index}"] = value
    return kinds, scalars


def _plan(
    zero: PortableZero, store: ChunkStore | None, params_only: bool = False, trained_only: bool = False
) -> Iterator[tuple[int, list[str], dict[str, Tensor]]]:
    """Per FlatParam: its index, kinds and the group scalars not yet yielded by an earlier one
    (``params_only``: the ``param`` kind alone, no scalars; ``trained_only``: with it, the
    frozen FlatParams left out)."""
    seen: set[str] = set()
    for fi in range(len(zero.flats)):
        if params_only and trained_only and zero.flats[fi].frozen:
            continue
        kinds, scalars = _kinds_and_scalars(zero, store, fi)
        if params_only:
            yield fi, ["param"], {}
            continue
        fresh = {k: v for k, v in scalars.items() if k not in seen}
        seen.update(fresh)
        yield fi, kinds, fresh


def full_state_layout(
    zero: PortableZero,
    store: ChunkStore | None = None,
    *,
    params_only: bool = False,
    trained_only: bool = False,
) -> Layout:
    """``(key, shape)`` of every tensor ``iter_full_state`` yields right now, in its order (no
    communication; every tensor is fp32)."""
    out: Layout = []
    for fi, kinds, scalars in _plan(zero, store, params_only, trained_only):
        out += [(key, ()) for key in scalars]
        flat = zero.flats[fi]
        out += [
            (f"{kind}/{n}", tuple(p.shape))
            for kind in kinds
            for n, p in zip(flat.names, flat.params, strict=True)
        ]
    return out


def _local_shard(zero: PortableZero, store: ChunkStore | None, fi: int, kind: str) -> Tensor:
    """This rank's shard of FlatParam ``fi``'s ``kind`` (a frozen master: in the compute dtype)."""
    flat = zero.flats[fi]
    if store is None:
        if kind == "param":
            return flat.master.detach()
        state: Tensor = zero.optimizer.state[flat.master][kind.removeprefix("optim.")]
        return state.detach()
    stream = MASTER if kind == "param" else kind.removeprefix("optim.")
    dtype = store.master_dtype(fi) if stream == MASTER else torch.float32
    shard = torch.empty(flat.layout.shard_numel, dtype=dtype, device=flat.device)
    with torch.no_grad():
        for segment in segments(store, fi):
            read_segment(store, fi, segment, stream, shard[segment[0] : segment[1]])
    return shard


def iter_full_state(
    zero: PortableZero,
    store: ChunkStore | None = None,
    *,
    params_only: bool = False,
    trained_only: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """Every parameter's master and optimizer state in full fp32 on the host, by name, and the
    scalar state per group, one tensor at a time in ``full_state_layout``'s order (collective
    over the group: one all-gather per FlatParam and kind, unless replicated). Consume it to
    the end on every rank. ``params_only``: the masters alone (``param/<name>``);
    ``trained_only`` (with ``params_only``): the trained parameters' alone, nothing of a frozen
    FlatParam gathered (a LoRA run's adapters without its base)."""
    for fi, kinds, scalars in _plan(zero, store, params_only, trained_only):
        for key, value in scalars.items():
            yield key, value.detach().to("cpu", torch.float32, copy=True)
        flat = zero.flats[fi]
        for kind in kinds:
            full = flat.gather_full(_local_shard(zero, store, fi, kind))
            for i, name in enumerate(flat.names):
                start, stop = flat.layout.span(i)
                value = full[start:stop].view(flat.params[i].shape)
                yield f"{kind}/{name}", value.to("cpu", torch.float32, copy=True)
            del full


def full_state(zero: PortableZero, store: ChunkStore | None = None) -> dict[str, Tensor]:
    """``iter_full_state`` as a dictionary (the whole model's state at once; collective)."""
    return dict(iter_full_state(zero, store))


class _Pieces:
    """Reads one kind of ``state`` into element ranges of a FlatParam's buffer, holding one
    parameter's tensor at a time (ranges are asked in increasing order)."""

    def __init__(self, flat: FlatParam, kind: str, state: Mapping[str, Tensor]) -> None:
        self.flat, self.kind, self.state = flat, kind, state
        self._held: tuple[int, Tensor] | None = None

    def _param(self, i: int) -> Tensor:
        if self._held is None or self._held[0] != i:
            self._held = None  # let the previous one go before reading the next
            key = f"{self.kind}/{self.flat.names[i]}"
            value = self.state[key]
            start, stop = self.flat.layout.span(i)
            if value.numel() != stop - start:
                raise ValueError(f"{key} has {value.numel()} elements, the parameter {stop - start}")
            self._held = (i, value.detach().reshape(-1))
        return self._held[1]

    def fill(self, out: Tensor, lo: int) -> None:
        """Set ``out`` to the flat buffer's elements ``[lo, lo + out.numel())`` (zero padding)."""
        hi = lo + out.numel()
        out.zero_()
        for i in range(len(self.flat.names)):
            start, stop = self.flat.layout.span(i)
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                out[a - lo : b - lo].copy_(self._param(i)[a - start : b - start])


def _check_keys(zero: PortableZero, keys: set[str], kinds: list[str]) -> None:
    for flat in zero.flats:
        for kind in ["param"] if flat.frozen else ["param", *kinds]:
            for name in flat.names:
                if f"{kind}/{name}" not in keys:
                    raise KeyError(f"the state to load lacks {kind}/{name!r}")


def load_full_state(zero: PortableZero, state: Mapping[str, Tensor], store: ChunkStore | None = None) -> None:
    """Set every master and the optimizer state from ``state`` (as ``iter_full_state`` yields
    it, from any stage and world size), one parameter at a time. Local; the owner then pushes
    the masters into the parameters (``ZeroOptimizer.load_full_state`` does)."""
    keys = list(state.keys())
    kinds = sorted({k.split("/", 1)[0] for k in keys if k.startswith("optim.") and "/group" not in k})
    if store is not None:
        extra = [k for k in kinds if k.removeprefix("optim.") not in store.state_names]
        if extra:
            raise ValueError(
                f"the state holds {extra}, not per-element state of {type(zero.optimizer).__name__} "
                f"(whose state streams are {list(store.state_names)})"
            )
    _check_keys(zero, set(keys), kinds)
    for fi, flat in enumerate(zero.flats):
        scalars: dict[str, Any] = {}
        for key in keys:
            kind, _, where = key.partition("/")
            if where == f"group{flat.group_index}":
                scalars[kind.removeprefix("optim.")] = state[key].clone()
        if flat.frozen:  # a frozen parameter has no optimizer state
            kinds_here, scalars = [], {}
        else:
            kinds_here = kinds
        with torch.no_grad():
            if store is None:
                _load_flat(zero, flat, state, kinds_here, scalars)
            else:
                _load_chunks(store, fi, state, kinds_here, scalars)


def _load_flat(
    zero: PortableZero,
    flat: FlatParam,
    state: Mapping[str, Tensor],
    kinds: list[str],
    scalars: dict[str, Any],
) -> None:
    lo, _ = flat.layout.shard_range(flat.shard_rank)
    master = flat.master
    _Pieces(flat, "param", state).fill(master.detach(), lo)
    entry: dict[str, Any] = {}
    for kind in kinds:
        shard = torch.empty_like(master.detach())
        _Pieces(flat, kind, state).fill(shard, lo)
        entry[kind.removeprefix("optim.")] = shard
    entry.update(scalars)
    if entry:
        zero.optimizer.state[master] = entry
    else:
        zero.optimizer.state.pop(master, None)


def _load_chunks(
    store: ChunkStore, fi: int, state: Mapping[str, Tensor], kinds: list[str], scalars: dict[str, Any]
) -> None:
    flat = store.flats[fi]
    base, _ = flat.layout.shard_range(flat.shard_rank)
    staging = torch.empty(store.chunk_numel, dtype=torch.float32)
    streams = [MASTER, *(k.removeprefix("optim.") for k in kinds)]
    for stream, kind in zip(streams, ["param", *kinds], strict=True):
        reader = _Pieces(flat, kind, state)  # one parameter's tensor held at a time
        for segment in segments(store, fi):
            lo, hi, _ = segment
            buf = staging[: hi - lo]
            reader.fill(buf, base + lo)
            write_segment(store, fi, segment, stream, buf)
    for chunk in store.chunks_of(fi):
        drop_streams(store, chunk, set(streams))
        chunk.scalars = {k: v.clone() for k, v in scalars.items()}
