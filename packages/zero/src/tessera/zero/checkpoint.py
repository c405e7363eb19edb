"""Sharded checkpoints: each rank's master shards and optimizer state as safetensors, plus JSON.

Directory layout: ``rank-RRRRR-of-NNNNN.safetensors`` per rank (master shards,
optimizer state tensors, the rank's model buffers; non-tensor optimizer state in the
safetensors header) and ``meta.json`` written by rank 0 last (format, world size, stage,
precision, optimizer class, the FlatParam layout, loss-scaler state and the sha256 of every
rank file). Every file is written atomically (temp file, fsync, ``os.replace``, directory
fsync), so ``meta.json`` commits a complete checkpoint. Nothing is unpickled.

At stage 0 (plain data parallelism) masters and optimizer state are the same on every rank,
so rank 0 writes the one file ``rank-00000-of-00001.safetensors`` (``"replicated": true`` in
``meta.json``) and every rank loads it; unless some FlatParams are sharded over another
group (expert parameters, ``tessera.zero.groups``), whose values differ between the ranks:
then every rank writes its own file, as in the other stages.

Loading reads ``meta.json`` and checks, before touching any state: the format, the world
size (a different one is refused naming both numbers), the stage, the optimizer class and
the layout; then the rank reads its file and verifies its checksum. Only then comes the
first collective: one all-reduce in which the ranks agree that every rank passed every
check, so a missing, foreign or corrupt file on one rank makes every rank raise (that rank
its own error) instead of leaving the others waiting in a collective.

Masters: ``master.<i>`` is FlatParam ``i``'s master shard as this rank holds it: fp32 for a
trained FlatParam, the compute dtype for a frozen one (which keeps no fp32 copy: its saved
value is the value the model computes with); the safetensors header records each tensor's
dtype. A checkpoint written before frozen FlatParams dropped their fp32 masters holds them
in fp32: it loads, each value rounded to the compute dtype as building the optimizer rounds
the model's own (so exactly what that optimizer computed with). Any other dtype is refused,
naming the tensor, before the ranks agree (``master_dtypes``).

What is saved is described by ``Checkpointable``: the public attributes of a
``ZeroOptimizer``. ``load`` restores the masters, buffers, optimizer and loss-scaler state
and returns the step count; the owner then pushes the masters into its parameters. How one
rank's file is written and read is pluggable (``RankWriter``, ``RankOpener``): by default it
is built in memory from the FlatParams' masters and the optimizer's state dict; the chunk
memory manager writes the same file chunk by chunk (``tessera.zero.chunks.checkpoint``), so
either kind of optimizer loads what the other saved.

A save comes in two halves (``begin_save``): ``ShardSave.write`` writes this rank's file and
runs no collective, so it may run in a background thread; ``ShardSave.commit`` is the
collective part (agree every rank wrote, gather the digests, rank 0 writes ``meta.json``)
and runs where the group's other collectives run. What ``meta.json`` records is taken when
the save begins. ``snapshot_writer`` copies the rank's state to host memory once, at once,
and writes that copy later, so training may go on between the halves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import safetensors.torch
import torch
from torch import Tensor, nn

from tessera.comm import Group, all_gather, group_rank
from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.comm.safefile import Entry, SafeFile, StreamWriter, tensor_bytes
from tessera.zero.flat_param import FlatParam
from tessera.zero.precision import DynamicLossScaler
from tessera.zero.validate import ZeroOptions

__all__ = [
    "FORMAT",
    "HEADER_KEY",
    "Checkpointable",
    "RankOpener",
    "RankWriter",
    "ShardSave",
    "begin_save",
    "buffers_payload",
    "check_master_dtype",
    "groups_payload",
    "json_ready",
    "load",
    "load_groups",
    "master_dtypes",
    "optimizer_index",
    "read_meta",
    "replicated_checkpoint",
    "save",
    "snapshot_writer",
    "write_tensors",
]

FORMAT = "tessera-zero/1"
META = "meta.json"
HEADER_KEY = "tessera-zero"  # the safetensors metadata key of the rank file's JSON

RankWriter = Callable[[Path], bytes]
"""Writes this rank's file atomically at the given path; returns its sha256 digest."""
RankOpener = Callable[[Path, str], Callable[[], None]]
"""Checks this rank's file against its hex sha256 (no collective; raises naming the file) and
returns what loads it into the optimizer once every rank has agreed."""


class Checkpointable(Protocol):
    """What a ZeRO checkpoint saves and restores (a ``ZeroOptimizer`` is one)."""

    @property
    def flats(self) -> Sequence[FlatParam]: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def group(self) -> Group: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def world_size(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def config(self) -> ZeroOptions: ...
    @property
    def scaler(self) -> DynamicLossScaler | None: ...
    @property
    def steps(self) -> int: ...


def replicated_checkpoint(zero: Checkpointable) -> bool:
    """Whether rank 0 alone writes the checkpoint (module docstring): stage 0, every FlatParam
    over the optimizer's group."""
    return zero.stage == 0 and all(f.group is zero.group for f in zero.flats)


def rank_file(rank: int, world: int) -> str:
    """The file name of ``rank``'s shard in a checkpoint of ``world`` ranks."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def master_dtypes(flat: FlatParam) -> tuple[torch.dtype, ...]:
    """The dtypes a checkpoint's ``master.<i>`` of ``flat`` may have, the one written first:
    fp32 for a trained FlatParam; the compute dtype for a frozen one, or fp32 as a checkpoint
    written when frozen FlatParams kept an fp32 master holds it (module docstring)."""
    return (flat.compute_dtype, torch.float32) if flat.frozen else (torch.float32,)


def check_master_dtype(flat: FlatParam, index: int, dtype: torch.dtype, file: Path) -> None:
    """Refuse a saved ``master.<index>`` of ``dtype`` that ``flat`` cannot take (ValueError
    naming the file, the tensor and the dtypes it may have)."""
    allowed = master_dtypes(flat)
    if dtype not in allowed:
        kind = "frozen" if flat.frozen else "trained"
        raise ValueError(
            f"{file}: master.{index} ({kind}, {flat.names[0]!r}...) is {dtype}, expected "
            f"{' or '.join(str(d) for d in dict.fromkeys(allowed))}"
        )


def _layout(zero: Checkpointable) -> list[dict[str, Any]]:
    return [
        {
            "group": f.group_index,
            "names": f.names,
            "shapes": [list(p.shape) for p in f.params],
            "padded_numel": f.layout.padded_numel,
        }
        for f in zero.flats
    ]


def _agree(zero: Checkpointable, error: BaseException | None, what: str) -> None:
    """Raise on every rank of the dp group if any rank failed (its own error on that rank)."""
    raise_together(error, zero.group, what, zero.device)


def json_ready(value: Any, where: str) -> Any:
    """``value`` itself if JSON can hold it, else a TypeError naming ``where``."""
    try:
        json.dumps(value)
    except TypeError as exc:
        raise TypeError(f"cannot save {where}={value!r} in a ZeRO checkpoint: not JSON") from exc
    return value


def groups_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list[dict[str, Any]]]:
    """Each parameter group's hyperparameters: tensor ones as ``group.<i>.<key>`` tensors, the
    rest as JSON (the parameters themselves are not saved: the layout is)."""
    tensors: dict[str, Tensor] = {}
    groups: list[dict[str, Any]] = []
    for gi, group in enumerate(optimizer.state_dict()["param_groups"]):
        entry_json: dict[str, Any] = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, Tensor):
                tensors[f"group.{gi}.{key}"] = host_copy(value)
            else:
                entry_json[key] = json_ready(value, f"param group {key}")
        groups.append(entry_json)
    return tensors, groups


def load_groups(
    optimizer: torch.optim.Optimizer,
    saved: list[dict[str, Any]],
    tensors: Mapping[str, Tensor],
    state: dict[int, dict[str, Any]],
) -> None:
    """Load the saved groups' hyperparameters (JSON ``saved``, tensor ones from ``tensors``) and
    ``state`` into ``optimizer``, keeping its own parameters."""
    current = optimizer.state_dict()["param_groups"]
    groups = []
    for gi, (entry, now) in enumerate(zip(saved, current, strict=True)):
        group = {k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in entry.items()}
        for key in tensors:
            if key.startswith(f"group.{gi}."):
                group[key.split(".", 2)[2]] = tensors[key]
        group["params"] = now["params"]
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def host_copy(tensor: Tensor) -> Tensor:
    """A host copy of ``tensor`` (one copy from any device; training may change the original)."""
    return tensor.detach().to("cpu", copy=True)


def write_tensors(target: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    """Write ``tensors`` as a safetensors file atomically at ``target`` straight from their
    memory (no serialized copy); its sha256 digest."""
    entries = [Entry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with StreamWriter(target, entries, metadata) as out:
        for t in tensors.values():
            out.write(tensor_bytes(t))
        return out.commit()


def buffers_payload(model: nn.Module) -> dict[str, Tensor]:
    """The model's buffers as ``buffer.<name>`` host tensors."""
    return {f"buffer.{name}": host_copy(buf) for name, buf in model.named_buffers()}


def optimizer_index(zero: Checkpointable) -> list[int]:
    """The index each FlatParam's master has in ``optimizer.state_dict()`` without chunks
    (the optimizer's groups hold the masters in FlatParam order, group by group)."""
    order = sorted(range(len(zero.flats)), key=lambda i: zero.flats[i].group_index)
    index = [0] * len(order)
    for position, fi in enumerate(order):
        index[fi] = position
    return index


def _rank_payload(zero: Checkpointable) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors: dict[str, Tensor] = {}
    for i, flat in enumerate(zero.flats):
        tensors[f"master.{i}"] = host_copy(flat.master)
    state: dict[str, dict[str, Any]] = {}
    for idx, entry in zero.optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{idx}.{key}"] = host_copy(value)
            else:
                state.setdefault(str(idx), {})[key] = json_ready(value, f"optimizer state {key}")
    group_tensors, groups = groups_payload(zero.optimizer)
    tensors.update(group_tensors)
    tensors.update(buffers_payload(zero.model))
    return tensors, {"state": state, "param_groups": groups}


def _write_flat_rank(zero: Checkpointable) -> RankWriter:
    def write(target: Path) -> bytes:
        tensors, extra = _rank_payload(zero)
        data = safetensors.torch.save(tensors, metadata={HEADER_KEY: json.dumps(extra)})
        atomic_write(target, data)
        return hashlib.sha256(data).digest()

    return write


def snapshot_writer(zero: Checkpointable) -> tuple[RankWriter, int]:
    """Copy this rank's file's tensors to host memory now; what writes that copy later (any
    thread) and the bytes copied."""
    tensors, extra = _rank_payload(zero)
    metadata = {HEADER_KEY: json.dumps(extra)}
    return (lambda target: write_tensors(target, tensors, metadata)), sum(
        t.numel() * t.element_size() for t in tensors.values()
    )


@dataclass
class ShardSave:
    """One save of a ZeRO checkpoint (module docstring): ``write`` then ``commit``."""

    path: Path
    group: Group
    device: torch.device
    meta: dict[str, Any]  # meta.json as of the beginning, without the digests
    index: int | None  # this rank's file in meta["files"]; None: it writes none
    writer: RankWriter
    digest: bytes = bytes(32)

    def write(self) -> None:
        """Write this rank's file (no collective; raises naming the file)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.index is not None:
            self.digest = self.writer(self.path / self.meta["files"][self.index])

    def commit(self, error: BaseException | None = None) -> None:
        """Collective over the group: every rank raises if any rank's ``write`` failed (its
        ``error``); else rank 0 writes ``meta.json`` with every rank's digest."""
        raise_together(error, self.group, "saving a shard", self.device)
        files = self.meta["files"]
        if len(files) == 1:
            digests = [self.digest]
        else:
            mine = torch.frombuffer(bytearray(self.digest), dtype=torch.uint8).to(self.device)
            gathered = all_gather(mine, self.group).cpu().view(len(files), 32)
            digests = [bytes(gathered[r].tolist()) for r in range(len(files))]
        failure = None
        if group_rank(self.group) == 0:
            try:
                meta = {**self.meta, "sha256": [d.hex() for d in digests]}
                atomic_write(self.path / META, json.dumps(meta, indent=1).encode())
            except Exception as exc:
                failure = exc
        raise_together(failure, self.group, "writing meta.json", self.device)


def begin_save(zero: Checkpointable, path: Path, write_rank: RankWriter | None = None) -> ShardSave:
    """The first half of a save under ``path`` (no I/O): what ``meta.json`` will record, as of
    now, and this rank's ``write_rank`` (default: the flat optimizer's, built in memory)."""
    rank, world = group_rank(zero.group), zero.world_size
    replicated = replicated_checkpoint(zero)
    files = [rank_file(0, 1)] if replicated else [rank_file(r, world) for r in range(world)]
    meta = {
        "format": FORMAT,
        "world_size": world,
        "stage": zero.stage,
        "replicated": replicated,
        "precision": zero.config.precision,
        "offload": zero.config.offload,
        "optimizer": type(zero.optimizer).__name__,
        "steps": zero.steps,
        "scaler": None if zero.scaler is None else zero.scaler.state_dict(),
        "files": files,
        "layout": _layout(zero),
    }
    index = (0 if rank == 0 else None) if replicated else rank
    writer = _write_flat_rank(zero) if write_rank is None else write_rank
    return ShardSave(path, zero.group, zero.device, json.loads(json.dumps(meta)), index, writer)


def save(zero: Checkpointable, path: Path, write_rank: RankWriter | None = None) -> None:
    """Write ``zero``'s shards under ``path`` (collective over its group); ``write_rank`` writes
    this rank's file (default: the flat optimizer's, built in memory and written at once)."""
    shard = begin_save(zero, path, write_rank)
    error: BaseException | None = None
    try:
        shard.write()
    except Exception as exc:
        error = exc
    shard.commit(error)


def read_meta(path: Path) -> dict[str, Any]:
    """The parsed ``meta.json`` of the checkpoint at ``path``."""
    meta_path = path / META
    if not meta_path.is_file():
        raise FileNotFoundError(f"no ZeRO checkpoint at {path}: {META} is missing (an unfinished save?)")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    return meta


def _check_meta(zero: Checkpointable, meta: dict[str, Any], path: Path) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / META}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["world_size"] != zero.world_size:
        raise ValueError(
            f"the checkpoint at {path} was saved by {meta['world_size']} ranks but this group has "
            f"{zero.world_size}; a sharded ZeRO checkpoint loads only at the world size it was saved at"
        )
    if meta["stage"] != zero.stage:
        raise ValueError(
            f"the checkpoint at {path} is ZeRO stage {meta['stage']}, this optimizer is {zero.stage}"
        )
    kind = type(zero.optimizer).__name__
    if meta["optimizer"] != kind:
        raise ValueError(
            f"the checkpoint at {path} holds {meta['optimizer']} state, this optimizer is {kind}"
        )
    mine = _layout(zero)
    if meta["layout"] != mine:
        diff = next(
            (i for i, (a, b) in enumerate(zip(meta["layout"], mine, strict=False)) if a != b),
            min(len(meta["layout"]), len(mine)),
        )
        where = _first_tensor(meta["layout"], mine, diff)
        raise ValueError(
            f"the checkpoint at {path} has a different parameter layout ({len(meta['layout'])} flat "
            f"buffers, this model {len(mine)}; first difference at buffer {diff}{where}): same model, "
            "parameter groups, stage, bucket size and precision are needed"
        )


def _first_tensor(saved: list[dict[str, Any]], mine: list[dict[str, Any]], i: int) -> str:
    """The first parameter of flat buffer ``i`` whose name or shape differs, as text."""
    a = saved[i] if i < len(saved) else {"names": [], "shapes": []}
    b = mine[i] if i < len(mine) else {"names": [], "shapes": []}
    pairs = list(zip(a["names"], a["shapes"], strict=True))
    ours = list(zip(b["names"], b["shapes"], strict=True))
    for k in range(max(len(pairs), len(ours))):
        if k >= len(pairs):
            return f", which lacks this model's {ours[k][0]!r} of shape {ours[k][1]}"
        if k >= len(ours) or pairs[k] != ours[k]:
            theirs = f"{pairs[k][0]!r} of shape {pairs[k][1]}"
            return f": saved {theirs}, this model " + (
                f"{ours[k][0]!r} of shape {ours[k][1]}" if k < len(ours) else "has nothing there"
            )
    return ""


def _open_flat_rank(zero: Checkpointable) -> RankOpener:
    def open_rank(file: Path, sha256: str) -> Callable[[], None]:
        data = file.read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError(f"{file}: checksum mismatch (the file changed after it was saved)")
        tensors = safetensors.torch.load(data)
        for i, flat in enumerate(zero.flats):
            if f"master.{i}" not in tensors:
                raise ValueError(f"{file} lacks the tensor 'master.{i}'")
            check_master_dtype(flat, i, tensors[f"master.{i}"].dtype, file)
        extra: dict[str, Any] = json.loads(SafeFile(file, data).metadata.get(HEADER_KEY, "{}"))
        return lambda: _apply_flat(zero, tensors, extra)

    return open_rank


def _apply_flat(zero: Checkpointable, tensors: dict[str, Tensor], extra: dict[str, Any]) -> None:
    with torch.no_grad():
        for i, flat in enumerate(zero.flats):
            flat.master.copy_(tensors[f"master.{i}"])  # (an older frozen fp32 one: rounded)
        for name, buf in zero.model.named_buffers():
            buf.copy_(tensors[f"buffer.{name}"])
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for idx, entry in extra["state"].items():
        state.setdefault(int(idx), {}).update(entry)
    load_groups(zero.optimizer, extra["param_groups"], tensors, state)


def _nothing() -> None:
    pass


def load(zero: Checkpointable, path: Path, open_rank: RankOpener | None = None) -> int:
    """Load the checkpoint at ``path`` into ``zero``'s masters, buffers, optimizer and loss
    scaler (collective over its group) and return the saved step count. ``open_rank`` checks
    this rank's file and returns what loads it (default: the flat optimizer's). The
    parameters are not refreshed from the masters here: that is the caller's."""
    error: BaseException | None = None
    meta: dict[str, Any] = {}
    apply: Callable[[], None] = _nothing
    try:
        meta = read_meta(path)
        _check_meta(zero, meta, path)
        index = 0 if meta.get("replicated") else group_rank(zero.group)
        opener = _open_flat_rank(zero) if open_rank is None else open_rank
        apply = opener(path / meta["files"][index], meta["sha256"][index])
    except Exception as exc:
        error = exc
    _agree(zero, error, "checking the checkpoint")
    apply()
    if zero.scaler is not None and meta["scaler"] is not None:
        zero.scaler.load_state_dict(meta["scaler"])
    return int(meta["steps"])
