"""Safetensors files written and read piece by piece, for state that never sits in memory whole.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``[begin, end)`` byte offsets in the data section, plus string metadata),
and the raw little-endian tensor bytes. Every size is known before the first byte of data,
so ``StreamWriter`` writes the header first and then takes the data in any number of pieces,
in header order, while it hashes them (sha256 of the whole file). It writes to a hidden
temporary file beside the target and commits it with ``tessera.comm.files.publish`` as
``atomic_write`` does (fsync, ``os.replace``, directory fsync), so readers see the previous
file or the whole new one. The result is an ordinary safetensors file (``safetensors.torch.load`` reads it).

``SafeFile`` parses a header (JSON only, checked against the file's size, nothing unpickled)
and reads any element range of a tensor into a caller's buffer with ``readinto``; no memory
map, so what was read counts towards the process's memory only while the caller holds it.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch
from torch import Tensor

from tessera.comm.files import publish

__all__ = ["DTYPES", "Entry", "SafeFile", "StreamWriter", "sha256_file", "tensor_bytes"]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the limit safetensors itself enforces
_BLOCK = 2**20


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a file: name, dtype, shape and (once placed) its byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0

    @property
    def numel(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.numel * self.dtype.itemsize

    @property
    def end(self) -> int:
        """One past the last data byte (relative to the data section)."""
        return self.begin + self.nbytes


def tensor_bytes(tensor: Tensor) -> memoryview:
    """The raw bytes of a host tensor (a view where it is contiguous, else of a copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy().data.cast("B")


def _header(entries: Sequence[Entry], metadata: Mapping[str, str]) -> bytes:
    body: dict[str, object] = {"__metadata__": dict(metadata)}
    for e in entries:
        if e.dtype not in DTYPES:
            raise TypeError(f"cannot write {e.name}: dtype {e.dtype} has no safetensors name")
        body[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class StreamWriter:
    """Writes a safetensors file of ``entries`` (laid out in this order) atomically at ``target``:
    ``write`` the data in order, in pieces of any size, then ``commit``; leaving the block
    without committing (an error) removes the temporary file and leaves ``target`` as it was."""

    def __init__(self, target: Path, entries: Sequence[Entry], metadata: Mapping[str, str]) -> None:
        placed, offset = [], 0
        for e in entries:
            placed.append(Entry(e.name, e.dtype, e.shape, offset))
            offset += e.nbytes
        self.entries = placed
        self.target = target
        self._total = offset
        self._written = 0
        self._hash = hashlib.sha256()
        header = _header(self.entries, metadata)
        self._tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(self._tmp, "wb")  # noqa: SIM115 (closed in commit or __exit__)
        self._put(header)

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def write(self, data: bytes | memoryview) -> None:
        """Append data bytes (the tensors' bytes in entry order)."""
        n = len(memoryview(data).cast("B"))
        if self._written + n > self._total:
            raise ValueError(
                f"{self.target}: {self._written + n} data bytes written, the header holds {self._total}"
            )
        self._put(data)
        self._written += n

    def commit(self) -> bytes:
        """Check every byte was written, make the file durable and visible; its sha256 digest."""
        if self._written != self._total:
            raise ValueError(
                f"{self.target}: {self._written} data bytes written, the header holds {self._total}"
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        publish(self._tmp, self.target)
        return self._hash.digest()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with open(path, "rb") as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


class SafeFile:
    """The header of a safetensors file, and reads of element ranges of its tensors. With
    ``data`` (the file's bytes, already read), the header is parsed from them, not the file."""

    def __init__(self, path: Path, data: bytes | None = None) -> None:
        self.path = path
        if data is None:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                raw = f.read(n) if 2 <= n <= min(_MAX_HEADER, size - 8) else b""
        else:
            size, n = len(data), int.from_bytes(data[:8], "little")
            raw = data[8 : 8 + n]
        if not 2 <= n <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: the safetensors header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object")
        self.data_start = 8 + n
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        self.entries: dict[str, Entry] = {}
        for name, info in header.items():
            try:
                dtype, shape = _BY_NAME[info["dtype"]], tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: malformed header entry {name!r}: {info!r}") from None
            entry = Entry(name, dtype, shape, begin)
            if end != entry.end or begin < 0 or self.data_start + end > size:
                raise ValueError(
                    f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) has bytes [{begin}, {end}), "
                    f"which do not fit its shape or the file ({size - self.data_start} data bytes)"
                )
            self.entries[name] = entry

    def entry(self, name: str, dtype: torch.dtype | None = None, shape: Sequence[int] | None = None) -> Entry:
        """The entry ``name``, checked against ``dtype`` and ``shape`` where given."""
        e = self.entries.get(name)
        if e is None:
            raise ValueError(f"{self.path} lacks the tensor {name!r}")
        if (dtype is not None and e.dtype != dtype) or (shape is not None and e.shape != tuple(shape)):
            raise ValueError(
                f"{self.path}: {name} is {e.dtype} {list(e.shape)}, expected {dtype or e.dtype} "
                f"{list(shape) if shape is not None else list(e.shape)}"
            )
        return e

    def read_into(self, f: io.BufferedReader, name: str, out: Tensor, start: int = 0) -> None:
        """Fill host tensor ``out`` (contiguous, of the entry's dtype) with elements
        ``[start, start + out.numel())`` of tensor ``name``, from the open file ``f``."""
        e = self.entries[name]
        if out.dtype != e.dtype or start < 0 or start + out.numel() > e.numel:
            raise ValueError(
                f"{self.path}: cannot read {out.numel()} {out.dtype} elements at {start} of {name} "
                f"({e.numel} {e.dtype})"
            )
        view = tensor_bytes(out) if out.numel() else memoryview(bytearray())
        f.seek(self.data_start + e.begin + start * e.dtype.itemsize)
        if f.readinto(view) != len(view):
            raise ValueError(f"{self.path}: {name} is cut short")

    def read(self, f: io.BufferedReader, name: str) -> Tensor:
        """A new host tensor holding tensor ``name`` (for the small ones)."""
        e = self.entries[name]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(f, name, out.view(-1) if out.dim() else out.reshape(1))
        return out
