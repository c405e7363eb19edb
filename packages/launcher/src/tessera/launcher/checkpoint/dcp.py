"""The serial model's weights in and out of ``torch.distributed.checkpoint`` (DCP), the format
FSDP2 and torchtitan save: ``dcp.save({"model": get_model_state_dict(model)}, ...)``.

`import_dcp` loads the model's weights from a DCP checkpoint folder into any layout: the
ranks check the checkpoint's metadata against the model first (every parameter under its
serial name, or the user's names it exports as, with its full shape; the persistent buffers
this rank holds; tied names, where saved, with their parameter's shape; nothing else in the
model's namespace), all on every rank, and refuse together with one ValueError naming the
names and shapes before anything changes. Then each rank reads the full value of each of its
parameters, one at a time (DCP joins the chunks the saving ranks wrote), and keeps its shard as
``import_weights`` does (``reshard.load_portable_state``); the optimizer state starts fresh.
The model's names are found under a prefix: ``model.`` as ``dcp.save({"model": ...})`` writes
them, none as torchtitan writes them, or any other (``app.model.``), whichever holds them.

`export_dcp` writes the serial model (its parameters, persistent buffers and tied names: what
``get_model_state_dict`` of the same model holds) as a DCP checkpoint that FSDP2 loads
(``dcp.load({"model": get_model_state_dict(fsdp_model)}, ...)``, then
``set_model_state_dict``): the ranks stream it one ZeRO flat buffer at a time into a staging
folder beside it (``consolidate.export_sharded``), and rank 0 writes it with DCP's writer one
tensor at a time, then removes the staging folder. Both need a folder every rank reads (import)
or that rank 0 reads and every rank writes (export), as ``consolidate`` does.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from tessera.comm import all_reduce
from tessera.comm.consensus import raise_together
from tessera.launcher.checkpoint.consolidate import MAX_SHARD_BYTES, export_sharded
from tessera.launcher.checkpoint.dcp_files import DCPReader, read_tensor, write_dcp
from tessera.launcher.checkpoint.exported import ExportPart, assemble, export_shapes, parts_of
from tessera.launcher.checkpoint.placement import Boosted, load_buffers
from tessera.launcher.checkpoint.reshard import load_portable_state
from tessera.launcher.checkpoint.tensorfile import LazyTensors, weight_files

__all__ = ["export_dcp", "find_prefix", "import_dcp"]

log = logging.getLogger(__name__)

Shapes = dict[str, tuple[int, ...]]


def find_prefix(keys: Collection[str], names: Collection[str]) -> str:
    """The dotted prefix under which the checkpoint keys ``keys`` hold most of the model's
    ``names`` (``"model"`` for ``model.<name>``, ``""`` for bare names; ``""`` when none is
    there); ValueError when two prefixes hold equally many."""
    counts: Counter[str] = Counter()
    for key in keys:
        counts[""] += key in names
        dot = key.find(".")
        while dot != -1:
            counts[key[:dot]] += key[dot + 1 :] in names
            dot = key.find(".", dot + 1)
    best = max(counts.values(), default=0)
    tops = sorted(p for p, n in counts.items() if n == best)
    if best and len(tops) > 1:
        raise ValueError(f"the model's names are saved under {len(tops)} prefixes {tops[:4]}; pass prefix=")
    return tops[0] if best else ""


def _parts(name: str, engine: Boosted) -> tuple[ExportPart, ...]:
    """The checkpoint tensors parameter ``name`` is read from (itself, or the user's names)."""
    return parts_of(name, engine.placement.exported) or (ExportPart(name),)


def _expected(engine: Boosted) -> tuple[Shapes, Shapes, Shapes]:
    """The model's tensors by checkpoint name and shape: every parameter (the same on every
    rank; under the names it exports as), the tied names (optional) and this rank's persistent
    buffers (under the names they export as)."""
    placement = engine.placement
    params = export_shapes(placement.full_shapes, placement.exported)
    tied = {alias: tuple(placement.full_shapes[name]) for alias, name in placement.aliases.items()}
    held = dict(engine.module.named_buffers())
    buffers = {
        part.name: tuple(held[local].shape) if part.view is None else part.view
        for local, serial in placement.buffers.items()
        for part in parts_of(serial, placement.exported)[:1]
    }
    return params, tied, buffers


class _Key:
    """A name's flattened key under a prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = f"{prefix}." if prefix else ""

    def __call__(self, name: str) -> str:
        return self.prefix + name


def _listed(what: str, items: list[str]) -> str:
    more = f", and {len(items) - 5} more" if len(items) > 5 else ""
    return f"{what} ({len(items)}): {', '.join(items[:5])}{more}"


def _check(saved: Mapping[str, tuple[int, ...]], prefix: str, wanted: Shapes, tied: Shapes) -> list[str]:
    """What in ``saved`` (flattened key -> shape) does not fit the model: names missing and
    shapes that differ (tied names only when saved)."""
    key = _Key(prefix)
    missing = sorted(n for n in wanted if key(n) not in saved)
    differ = sorted(
        f"{n} saved {list(saved[key(n)])}, the model's {list(shape)}"
        for n, shape in {**tied, **wanted}.items()
        if key(n) in saved and tuple(saved[key(n)]) != tuple(shape)
    )
    out = [_listed("missing", missing)] if missing else []
    return out + ([_listed("shapes differ", differ)] if differ else [])


def _foreign(saved: Collection[str], prefix: str, known: Collection[str]) -> list[str]:
    """The keys of ``saved`` in the model's namespace that are none of ``known`` (names): under
    ``prefix.`` when there is one, else those whose first component is one of the model's own
    (``layers.9.w`` for a model of ``layers.*``; a full checkpoint's ``optimizer.*`` is not)."""
    key = _Key(prefix)
    wanted = {key(n) for n in known}
    if prefix:
        return sorted(k for k in saved if k.startswith(prefix + ".") and k not in wanted)
    tops = {n.split(".", 1)[0] for n in known}
    return sorted(k for k in saved if k.split(".", 1)[0] in tops and k not in wanted)


class _Params(Mapping[str, Tensor]):
    """Every parameter's full fp32 value as the portable state's ``param/<name>``, read from
    the checkpoint on access (a parameter exported as several tensors: `assemble`d)."""

    def __init__(self, engine: Boosted, reader: DCPReader, prefix: str) -> None:
        self._engine, self._reader, self._key = engine, reader, _Key(prefix)
        self._names = set(engine.placement.full_shapes)

    def __getitem__(self, key: str) -> Tensor:
        if key not in self:
            raise KeyError(key)
        parts = _parts(key.removeprefix("param/"), self._engine)
        values = [read_tensor(self._reader, self._key(p.name)) for p in parts]
        return assemble(parts, values).to(torch.float32)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.startswith("param/") and key[6:] in self._names

    def __iter__(self) -> Iterator[str]:
        return (f"param/{name}" for name in self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Buffers(Mapping[str, Tensor]):
    """The saved tensors by serial name, read on access (for ``reshard.load_buffers``)."""

    def __init__(self, reader: DCPReader, prefix: str, names: Collection[str]) -> None:
        self._reader, self._key, self._names = reader, _Key(prefix), set(names)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        return read_tensor(self._reader, self._key(name))

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def import_dcp(engine: Boosted, path: str | Path, *, prefix: str | None = None) -> None:
    """Load the weights of the DCP checkpoint folder ``path`` into this rank's shards (see the
    module); ``prefix``: where the model's names are (found when None). Collective over every
    rank: the ranks agree the folder is readable, then (one all-reduce) which saved names no
    rank's model has, and refuse together before anything changes."""
    path, device = Path(path), engine.mesh.device
    params, tied, buffers = _expected(engine)
    error: BaseException | None = None
    saved: dict[str, tuple[int, ...]] = {}
    reader: DCPReader | None = None
    try:
        reader = DCPReader(path)
        saved = dict(reader.tensors())
        prefix = find_prefix(saved, {*params, *tied}) if prefix is None else prefix.strip(".")
    except (OSError, ValueError) as e:
        error = e
    raise_together(error, None, f"reading the DCP checkpoint {path}", device)
    assert reader is not None and prefix is not None
    problems = _check(saved, prefix, {**params, **buffers}, tied)
    # another stage's buffers are unknown here: a saved name is foreign when no rank knows it
    candidates = _foreign(saved, prefix, {*params, *tied})
    known, known_prefix = {_Key(prefix)(b) for b in buffers}, _Key(prefix).prefix
    foreign: list[str] = []
    if candidates:  # the same on every rank (the names of every parameter, the same metadata)
        flags = torch.tensor([k not in known for k in candidates], dtype=torch.int32, device=device)
        foreign = [k for k, f in zip(candidates, all_reduce(flags, None, "min").tolist(), strict=True) if f]
    problems += [_listed("not in the model", [k[len(known_prefix) :] for k in foreign])] if foreign else []
    where = f" (under {prefix!r})" if prefix else ""
    error = ValueError(f"{path} does not hold this model's weights{where}: " + "; ".join(problems))
    raise_together(error if problems else None, None, f"importing {path}", device)
    error = None
    try:
        load_portable_state(engine, _Params(engine, reader, prefix), {})
        load_buffers(engine, _Buffers(reader, prefix, buffers), path)
    except (OSError, ValueError, RuntimeError) as e:
        error = e
    raise_together(error, None, f"importing {path}", device)
    log.info("imported the DCP checkpoint %s%s into %s", path, where, engine.mesh.topology.describe())


def export_dcp(
    engine: Boosted,
    path: str | Path,
    *,
    prefix: str = "model",
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the serial model as the DCP checkpoint folder ``path`` (see the module), every
    tensor under ``prefix.<name>`` (``"model"``: as ``dcp.save({"model": state})`` writes; ``""``:
    bare names, as torchtitan writes), floating tensors in ``dtype``; ``max_shard_bytes``: the
    staging shards' size. Collective over every rank; returns ``path``."""
    path = Path(path)
    if prefix and any(not part for part in prefix.split(".")):
        raise ValueError(f"prefix {prefix!r} is not a dotted name such as 'model' or 'app.model'")
    staging = path.parent / f".{path.name}.parts"
    error: BaseException | None = None
    try:
        export_sharded(engine, staging, max_shard_bytes=max_shard_bytes, dtype=dtype)
        if engine.mesh.rank == 0:
            try:
                _write(engine, staging, path, prefix)
            except (OSError, RuntimeError, ValueError) as e:
                error = e
    finally:
        if engine.mesh.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    raise_together(error, None, f"writing the DCP checkpoint {path}", engine.mesh.device)
    log.info("wrote the DCP checkpoint %s", path)
    return path


def _write(engine: Boosted, staging: Path, path: Path, prefix: str) -> None:
    """Rank 0: the staged shards, and every tied name beside its parameter, into DCP."""
    with LazyTensors(weight_files(staging)) as weights:
        aliases = {a: n for a, n in engine.placement.aliases.items() if n in weights}
        names = {n: n for n in weights} | aliases
        shapes = {a: (weights.shape(n), weights.dtype(n)) for a, n in names.items()}
        write_dcp(path, shapes, lambda name: weights[names[name]], prefix)
