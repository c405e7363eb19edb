"""``torch.distributed.checkpoint`` (DCP) folders read and written one tensor at a time, with
DCP's own file-system reader and writer, in one process (``no_dist``: no process group).

A DCP folder is a ``.metadata`` file (a pickle, written last: the commit point) beside data
files of ``torch.save``'d tensor chunks. `DCPReader` unpickles the metadata through an
allowlist of DCP's metadata classes (the data files DCP itself reads with ``torch.load(...,
weights_only=True)``), so a checkpoint from elsewhere cannot run code when read; `read_tensor`
loads one tensor in full, joining the chunks the ranks that saved it wrote. `write_dcp` writes
a flat set of named tensors as one DCP checkpoint, each tensor fetched when DCP writes it into
a file of its own, so only one tensor is held at a time.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

__all__ = ["METADATA", "DCPReader", "read_tensor", "write_dcp"]

METADATA = ".metadata"  # DCP's metadata file, the commit point of a checkpoint folder

_ALLOWED = {  # what a DCP checkpoint's metadata is made of, and nothing else
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch sizes, dtypes and layouts, and paths only."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class DCPReader(FileSystemReader):
    """DCP's file-system reader of the folder ``path``, its metadata read once, through the
    allowlist (ValueError naming the file when it is missing or holds anything else)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        where = Path(path) / METADATA
        if not where.is_file():
            raise ValueError(f"{path} is no torch.distributed.checkpoint folder: it has no {METADATA}")
        try:
            with open(where, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{where} is not DCP metadata: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{where} is not DCP metadata: it holds a {type(metadata).__name__}")
        self.metadata = metadata
        _check_files(Path(path), metadata)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata read at construction (what DCP's reader would unpickle each time)."""
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor of the checkpoint: its flattened key and shape (nothing is read)."""
        for key, entry in self.metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                yield key, tuple(entry.size)


def _check_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata names is there and long enough for what it places in it
    (ValueError naming the file): a lost or cut-short file is found before anything is read."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{path / name} is missing: the checkpoint's {METADATA} names it") from None
        if size < end:
            raise ValueError(f"{path / name} is cut short: {size} bytes, {METADATA} places data up to {end}")


@contextmanager
def _single_process(what: str) -> Iterator[None]:
    """DCP used on purpose in one process (its warning that it assumes so is expected); its
    failure, a ``CheckpointException`` (a BaseException carrying each rank's traceback), raised
    as one line naming ``what`` and the first cause (OSError for one, else ValueError)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as exc:
            first = next((cause for cause, _ in exc.failures.values()), exc)
            kind = OSError if isinstance(first, OSError) else ValueError
            text = " ".join(str(first).split())
            text = text if len(text) <= 240 else text[:240] + "..."
            raise kind(f"{what}: {type(first).__name__}: {text}") from None


def read_tensor(reader: DCPReader, key: str) -> Tensor:
    """The full tensor saved under the flattened ``key``, on the host in its saved dtype (DCP
    reads only the chunks it is made of; no collective)."""
    entry = reader.metadata.state_dict_metadata[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise ValueError(f"{reader.path}: {key!r} is saved as an object, not a tensor")
    out = {key: torch.empty(entry.size, dtype=entry.properties.dtype)}
    with _single_process(f"reading {key!r} from {reader.path}"):
        load(out, storage_reader=reader, no_dist=True)
    return out[key]


class _Fetching(DefaultSavePlanner):
    """DCP's default save planner over placeholders (meta tensors: shapes and dtypes), each
    tensor's value fetched by its flattened key when the writer asks for it."""

    def __init__(self, fetch: Callable[[str], Tensor]) -> None:
        super().__init__()
        self._fetch = fetch

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            data: Tensor | io.BytesIO = super().resolve_data(write_item)
            return data
        return self._fetch(write_item.index.fqn).detach().to("cpu")


def write_dcp(
    path: Path,
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], Tensor],
    prefix: str,
) -> None:
    """Write the tensors ``shapes`` names (name -> shape and dtype) as the DCP checkpoint
    ``path``, each under ``prefix.<name>`` (nested as ``dcp.save({prefix: state})`` nests it;
    ``""``: bare names), its value ``fetch(name)`` taken as DCP writes it, into a file of its
    own. A checkpoint already there is uncommitted first (its ``.metadata`` removed), so a
    failed write never leaves old metadata over new data; DCP writes the new one last."""
    path.mkdir(parents=True, exist_ok=True)
    (path / METADATA).unlink(missing_ok=True)
    state: dict[str, Any] = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in shapes.items()}
    for part in reversed(prefix.split(".") if prefix else []):
        state = {part: state}
    skip = len(prefix) + 1 if prefix else 0

    def value(key: str) -> Tensor:
        name = key[skip:]
        got = fetch(name)
        want = shapes[name]
        if tuple(got.shape) != want[0] or got.dtype != want[1]:
            raise ValueError(f"{name}: got {got.dtype} {tuple(got.shape)}, planned {want[1]} {want[0]}")
        return got

    writer = FileSystemWriter(path, single_file_per_rank=False, thread_count=1, overwrite=True)
    with _single_process(f"writing {path}"):
        save(state, storage_writer=writer, planner=_Fetching(value), no_dist=True)
