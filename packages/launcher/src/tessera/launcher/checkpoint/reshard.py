"""Checkpoints that load under another topology: each generation also holds its training
state in full, by serial parameter name, so that a run with other dp / pp / tp / cp degrees,
another tensor-parallel mode or another ZeRO stage resumes it exactly.

``portable/pp-K.safetensors`` (one per pipeline rank, written by its dp 0 / tp 0 / cp 0 rank):
for every parameter of the stages that rank holds, the fp32 master and each elementwise
optimizer state tensor (``param/<name>``, ``optim.<key>/<name>``; gathered over ZeRO's group,
then unsharded over tp by each parameter's ``ShardSpec`` and, for an expert bank, over the ep
group: ``consolidate.full_tensor``) and each optimizer group's scalar
state (``optim.step/group<i>``); its header holds the step, the optimizer groups'
hyperparameters (the learning rate a schedule reached) and the fp16 loss scaler's state
(``DynamicLossScaler.state_dict``). Loading reads every part, keeps each rank's experts of
each expert bank and its tensor-parallel shard of each of its parameters and hands them to
ZeRO, which keeps its own shard (``tessera.zero.portable``). The files are
listed with their checksums in the generation's manifest like every other. Not carried
across topologies: the RNG state (the ranks' streams differ) and module buffers (the
reference models have none that are saved).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm.safefile import Entry, StreamWriter, tensor_bytes
from tessera.launcher.checkpoint.adapted import Adapters
from tessera.launcher.checkpoint.consolidate import full_tensor
from tessera.launcher.checkpoint.exported import ExportPart, assemble, found_parts, parts_of, sliced
from tessera.launcher.checkpoint.placement import Boosted, load_buffers, local_part
from tessera.launcher.checkpoint.tensorfile import LazyTensors, weight_files

__all__ = [
    "PORTABLE",
    "import_weights",
    "load_portable_state",
    "read_portable",
    "snapshot_portable",
    "write_portable",
]

PORTABLE = "portable"


_PLAIN = (int, float, bool, str, tuple)  # optimizer hyperparameters the header carries


def _part(gen: Path, pp_rank: int) -> Path:
    return gen / PORTABLE / f"pp-{pp_rank:03d}.safetensors"


def _portable_plan(engine: Boosted, gen: Path, step: int) -> tuple[Path, list[Entry], dict[str, str]] | None:
    """Where this rank writes its pipeline rank's part, its entries and header (None: one of
    the other ranks of its pipeline rank writes it)."""
    mesh, zero = engine.mesh, engine.zero
    if not all(mesh.coordinate(axis) == 0 for axis in ("dp", "tp", "cp")):
        return None
    entries, full = [], _namer(engine)
    for key, shape in zero.full_state_layout():
        name, full_shape = full(key)
        entries.append(Entry(name, torch.float32, shape if full_shape is None else full_shape))
    scaler = zero.scaler.state_dict() if zero.scaler is not None else None
    groups = [
        {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple))}
        for g in zero.optimizer.param_groups
    ]
    header = {"step": step, "loss_scaler": scaler, "zero_steps": zero.steps, "param_groups": groups}
    return _part(gen, mesh.coordinate("pp")), entries, {"tessera": json.dumps(header)}


def _namer(engine: Boosted) -> Callable[[str], tuple[str, tuple[int, ...] | None]]:
    """What gives the saved name of ZeRO's full-state key and its full shape (None: a scalar)."""
    placement, zero = engine.placement, engine.zero
    serial = {n: placement.names[p] for f in zero.flats for n, p in zip(f.names, f.params, strict=True)}
    return lambda key: _full(serial, placement.full_shapes, key)


def _full(
    serial: dict[str, str], shapes: Mapping[str, Sequence[int]], key: str
) -> tuple[str, tuple[int, ...] | None]:
    kind, _, name = key.partition("/")
    if name.startswith("group") and name not in serial:
        return key, None
    return f"{kind}/{serial[name]}", tuple(shapes[serial[name]])


def _portable_values(engine: Boosted) -> Iterator[Tensor]:
    """The portable state's tensors in file order, full and fp32 (collective: all-gathers over
    ZeRO's group, tp and ep; every rank consumes it to the end)."""
    full = _namer(engine)
    for key, value in engine.zero.iter_full_state():
        name, full_shape = full(key)
        if full_shape is not None:
            value = full_tensor(engine, name.partition("/")[2], value)
        yield value.to(torch.float32)


def write_portable(engine: Boosted, gen: Path, step: int) -> Path | None:
    """Write this pipeline rank's part under ``gen`` (collective over every rank: all-gathers
    over ZeRO's group and tp; one rank per pipeline rank writes); the file this rank wrote.
    The tensors stream into the file one at a time behind a header laid out beforehand
    (``full_state_layout``), so no rank holds more than one flat buffer's state in full."""
    plan = _portable_plan(engine, gen, step)
    with contextlib.ExitStack() as stack:
        writer = None if plan is None else stack.enter_context(StreamWriter(*plan))
        for value in _portable_values(engine):
            if writer is not None:
                writer.write(tensor_bytes(value))
        if writer is not None:
            writer.commit()
    return None if plan is None else plan[0]


def snapshot_portable(engine: Boosted, gen: Path, step: int) -> tuple[Path, Callable[[], str], int] | None:
    """``write_portable`` in halves: the gathers now (collective) into one host copy of this
    pipeline rank's part on the rank that writes it; there, the file, what writes that copy
    later (no collective, any thread; returns the file's hex sha256) and the bytes copied.
    None on the other ranks."""
    plan = _portable_plan(engine, gen, step)
    values = [v.detach().to("cpu", copy=True) if plan is not None else None for v in _portable_values(engine)]
    if plan is None:
        return None
    target, entries, metadata = plan
    tensors = [v for v in values if v is not None]

    def write() -> str:
        with StreamWriter(target, entries, metadata) as out:
            for t in tensors:
                out.write(tensor_bytes(t))
            return out.commit().hex()

    return target, write, sum(t.numel() * t.element_size() for t in tensors)


def read_portable(gen: Path, pp: int) -> tuple[LazyTensors, dict[str, Any]]:
    """Every part of the portable state of generation ``gen`` saved with ``pp`` pipeline
    ranks, as one mapping read on access, and the header of the first (ValueError naming a
    missing part)."""
    parts = [_part(gen, k) for k in range(pp)]
    for part in parts:
        if not part.is_file():
            missing = part.relative_to(gen)
            raise ValueError(f"{gen} has no {missing}: it cannot be loaded under another topology")
    state = LazyTensors(parts)
    return state, json.loads(state.metadata(0)["tessera"])


class _TPShards(Mapping[str, Tensor]):
    """This rank's parts of the full tensors of ``state`` (its experts of an expert bank, then
    its tensor-parallel shard), by the local names ZeRO knows, each read and cut on access
    (ValueError naming a missing or misshapen one)."""

    def __init__(self, engine: Boosted, state: Mapping[str, Tensor]) -> None:
        self._state, self._engine = state, engine
        kinds = sorted({k.split("/", 1)[0] for k in state if "/group" not in k})
        self._keys: dict[str, tuple[str, str, nn.Parameter]] = {}
        for flat in engine.zero.flats:
            for name, param in zip(flat.names, flat.params, strict=True):
                full_name = engine.placement.names[param]
                for kind in ["param"] if flat.frozen else kinds:  # a frozen one has no optimizer state
                    self._keys[f"{kind}/{name}"] = (kind, full_name, param)
        self._scalars = {k for k in state if "/group" in k}

    def __getitem__(self, key: str) -> Tensor:
        if key in self._scalars:
            return self._state[key]
        kind, full_name, param = self._keys[key]
        if f"{kind}/{full_name}" not in self._state:
            raise ValueError(f"the saved state lacks {kind}/{full_name}")
        mesh, placement = self._engine.mesh, self._engine.placement
        span = placement.experts.get(full_name)
        try:
            if span is not None and isinstance(self._state, _AsParams):  # only this rank's experts
                mine = self._state.rows(f"{kind}/{full_name}", *span)
                specs = placement.shard_specs
                return local_part(
                    mine, full_name, specs, {}, mesh.coordinate("tp"), mesh.size("tp"), param.shape
                )
            full = self._state[f"{kind}/{full_name}"]
            return placement.part(full, full_name, mesh.coordinate("tp"), mesh.size("tp"), param.shape)
        except ValueError as exc:
            raise ValueError(f"the saved {kind}/{exc}") from None

    def __contains__(self, key: object) -> bool:
        return key in self._scalars or key in self._keys

    def missing(self) -> list[str]:
        """The saved tensors this rank needs that ``state`` lacks."""
        wanted = {f"{kind}/{full_name}" for kind, full_name, _ in self._keys.values()}
        return sorted(k for k in wanted if k not in self._state)

    def __iter__(self) -> Iterator[str]:
        yield from self._keys
        yield from self._scalars

    def __len__(self) -> int:
        return len(self._keys) + len(self._scalars)


def load_portable_state(engine: Boosted, state: Mapping[str, Tensor], header: dict[str, Any]) -> None:
    """Give this rank's ZeRO its parameters' tensor-parallel shards of ``state`` (read one
    parameter at a time); local."""
    zero = engine.zero
    local = _TPShards(engine, state)
    missing = local.missing()  # refused before anything changes
    if missing:
        raise ValueError(f"the saved state lacks {len(missing)} tensors, e.g. {missing[:5]}")
    zero.load_full_state(local, int(header.get("zero_steps", zero.steps)))
    saved_groups = header.get("param_groups", [{} for _ in zero.optimizer.param_groups])
    if len(saved_groups) != len(zero.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} optimizer groups, this optimizer "
            f"{len(zero.optimizer.param_groups)}"
        )
    for group, saved in zip(zero.optimizer.param_groups, saved_groups, strict=True):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    if zero.scaler is not None and header.get("loss_scaler") is not None:
        zero.scaler.load_state_dict(header["loss_scaler"])
    elif zero.scaler is not None and header.get("loss_scale") is not None:  # a header with the scale only
        zero.scaler.scale = float(header["loss_scale"])


class _AsParams(Mapping[str, Tensor]):
    """A checkpoint's tensors as the portable state's ``param/<name>`` in fp32: parameter ``name``
    assembled from the file's tensors ``sources[name]`` (under its own name, or the parts it
    exports as: `tessera.launcher.checkpoint.exported`), else taken from ``extra``."""

    def __init__(
        self,
        weights: LazyTensors,
        sources: Mapping[str, tuple[ExportPart, ...]],
        extra: Mapping[str, Tensor],
    ) -> None:
        self._weights, self._sources, self._extra = weights, sources, extra

    def __getitem__(self, key: str) -> Tensor:
        name = key.removeprefix("param/")
        if key not in self:
            raise KeyError(key)
        return self._read(name, None) if name in self._sources else self._extra[name].float()

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        """Experts ``start:stop`` (first dimension) of the bank ``key``, reading only theirs:
        those experts' own tensors, or their rows of a stacked one."""
        name = key.removeprefix("param/")
        return self._read(name, (start, stop)) if name in self._sources else self[key][start:stop]

    def _read(self, name: str, experts: tuple[int, int] | None) -> Tensor:
        """Parameter ``name`` (its ``experts`` only, when given) from its parts, each tensor
        read once and only as far as the part needs (`LazyTensors.read_part`: its band of a joined
        tensor)."""
        parts, by_rows = self._sources[name], False
        if experts is not None:
            parts, by_rows = sliced(parts, *experts)
        first = experts if by_rows else None
        values = [
            self._weights[p.name]
            if first is None and p.band is None
            else self._weights.read_part(p.name, first, p.band)
            for p in parts
        ]
        return assemble([replace(p, band=None) for p in parts], values).float()  # the bands cut already

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor to find out
        name = key.removeprefix("param/") if isinstance(key, str) else None
        return (
            isinstance(key, str)
            and key.startswith("param/")
            and (name in self._sources or name in self._extra)
        )

    def __iter__(self) -> Iterator[str]:
        return (f"param/{name}" for name in {*self._sources, *self._extra})

    def __len__(self) -> int:
        return len({*self._sources, *self._extra})


def _source(name: str, weights: Mapping[str, Tensor], adapters: Adapters) -> str | None:
    """Where a file holds parameter ``name``: under its own name, or, for an adapted layer's base
    (``q_proj.base_layer.weight``) or a layer kept as copies (``lm_head.original_module.weight``,
    ``lm_head.modules_to_save.default.weight``), under the plain model's (``q_proj.weight``,
    ``lm_head.weight``: a pretrained checkpoint); None when it holds neither."""
    if name in weights:
        return name
    copy = adapters.copy_of(name)  # a layer trained as a copy: its original's and copies' start
    if copy is not None:
        plain = f"{copy[0]}.{copy[2]}"
        return plain if plain in weights else None
    owner = adapters.owner(name)
    if owner is not None and name.startswith(f"{owner}.base_layer."):
        plain = f"{owner}.{name.removeprefix(f'{owner}.base_layer.')}"
        return plain if plain in weights else None
    return None


def _file_parts(engine: Boosted, name: str, weights: LazyTensors) -> tuple[ExportPart, ...] | None:
    """Where the file holds parameter ``name``: the parts it exports as (a converted mixture's
    bank), or their ``legacy`` ones (transformers' per-expert layout); else `_source`; else its
    band of a tensor transformers splits on load (``Placement.renames``)."""
    placement = engine.placement
    exported, adapters, renames = placement.exported, placement.adapters, placement.renames
    if name in exported:
        parts = found_parts(exported[name], weights.__contains__)
        return None if parts is None else tuple(_as_stored(p, weights) for p in parts)
    plain = _source(name, weights, adapters)
    if plain is not None:
        return (_as_stored(ExportPart(plain), weights),)
    if renames is None:
        return None
    owner = adapters.owner(name)  # an adapted layer's base: the plain model's name
    base = f"{owner}.base_layer."
    unadapted = f"{owner}.{name.removeprefix(base)}" if owner is not None and name.startswith(base) else name
    split = renames.parts(unadapted)  # its band of a tensor split on load
    return found_parts(split, weights.__contains__) if split else None


def _as_stored(part: ExportPart, weights: LazyTensors) -> ExportPart:
    """``part`` as the file holds it: transposed where transformers transposes the stored tensor
    on load (Ergo's ``gate_kernel``: `LazyTensors.transposed`)."""
    if not weights.transposed(part.name):
        return part
    return replace(part, transpose=not part.transpose)


def _wanted_as(name: str, exported: Mapping[str, tuple[ExportPart, ...]]) -> str:
    """Parameter ``name`` as a file would hold it, for an error: its first exported tensor (and
    the first of the older layout's)."""
    parts = parts_of(name, exported) or (ExportPart(name),)
    legacy = f" (or {parts[0].legacy[0].name}, ...)" if parts[0].legacy else ""
    return parts[0].name + legacy


def import_weights(engine: Boosted, path: Path, extra: Mapping[str, Tensor] | None = None) -> None:
    """Load a consolidated state dict (``Engine.consolidate``'s file or folder, or any
    safetensors checkpoint of the serial model's parameters by name, e.g. a Hugging Face one,
    sharded with its index or not: ``tensorfile.weight_files``) into this rank's shards, one
    parameter at a time, and the persistent buffers it holds; the optimizer state starts
    fresh. An adapted layer's base (``q_proj.base_layer.weight``) is read under the plain
    model's name when the file has it so (a pretrained checkpoint); a parameter boost() trains
    under a name of its own (a converted mixture's bank) from the tensors it exports as
    (``Placement.exported``: HF's ``experts.gate_up_proj``, or transformers' per-expert
    ``experts.<e>.w1.weight`` as ``save_pretrained`` writes them), and of an expert bank split
    over ep only this rank's experts are read (their rows of a stacked tensor, or their own
    tensors); ``extra``: the full values of parameters the file does not hold (new adapters),
    by serial name. Local (each rank reads the file); ValueError naming the missing or
    misshapen parameters before anything changes."""
    extra = extra or {}
    shapes = engine.placement.full_shapes
    renames = engine.placement.renames
    with LazyTensors(weight_files(path), rename=None if renames is None else renames.read) as weights:
        wanted = {engine.placement.names[p] for flat in engine.zero.flats for p in flat.params}
        found = {n: _file_parts(engine, n, weights) for n in wanted}
        sources = {n: s for n, s in found.items() if s is not None}
        missing = sorted(_wanted_as(n, engine.placement.exported) for n in wanted - set(sources) - set(extra))
        if missing:
            why = renames.unread(weights.stored(n) for n in weights) if renames is not None else ""
            lacks = f"{path} lacks {len(missing)} parameters of the model, e.g. {missing[:5]}"
            raise ValueError(lacks + (f"; {why}" if why else ""))
        misshapen = sorted(
            f"{weights.stored(p.name)} {list(weights.shape(p.name))} (for {n} {list(shapes[n])})"
            for n, parts in sources.items()
            for p in parts
            if not p.fits(shapes[n], weights.shape(p.name))
        )
        if misshapen:
            raise ValueError(f"{path}: {len(misshapen)} tensors do not fit the model: {misshapen[:5]}")
        load_portable_state(
            engine, _AsParams(weights, sources, {n: extra[n] for n in wanted - set(sources)}), {}
        )
        load_buffers(engine, weights, path)
