"""The disk tier: one plain ``.npy`` array file per chunk stream, in a private directory.

Files are NumPy's plain array format (a short text header naming dtype and shape, then the
raw little-endian elements), readable by ``numpy.load``; a bfloat16 stream (a frozen chunk's
values under bf16), which NumPy has no type for, is stored as its raw bits, ``int16``
(``torch.from_numpy(a).view(torch.bfloat16)`` reads it back); nothing is pickled, and a read
compares the header with the expected bytes rather than evaluating it. Each
write goes to a temporary file that replaces the old one with ``os.replace``, so a file is
either the previous stream or the new one, never half of each. The CRC-32 of every write is
kept in memory and checked on every read, with the header and the length, so a missing,
truncated or altered file is a ``ChunkFileError`` naming the chunk, the stream and the path.
A *pending* write (``write(..., pending=True)``: a step taken during backward, not yet
committed by ``step()``) goes to a file of its own beside the stream's; ``commit`` makes it
the stream (one ``os.replace``), ``drop_pending`` forgets it, and reads see the committed
stream until then.

Reads go straight into a host staging tensor with ``readinto`` rather than through a memory
map: mapped pages count towards the process's resident memory until the kernel decides to
drop them, which would let the host budget be exceeded silently; read pages stay in the
page cache, which the kernel reclaims first and the process's RSS does not count. The
directory is scratch space for this run (removed by ``close``), not a checkpoint.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
import threading
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["ChunkFileError", "DiskTier"]

log = logging.getLogger(__name__)


def _header(array: np.ndarray) -> bytes:
    """The .npy (version 1.0) header of ``array``. Reads compare it byte for byte instead of
    parsing it: NumPy parses headers with ``ast.literal_eval``, which CPython 3.11 does not
    make safe to run on several threads at once (the prefetch thread and the ranks)."""
    buf = io.BytesIO()
    fields = {
        "descr": np.lib.format.dtype_to_descr(array.dtype),
        "fortran_order": False,
        "shape": array.shape,
    }
    np.lib.format.write_array_header_1_0(buf, fields)
    return buf.getvalue()


def _numpy(tensor: Tensor) -> np.ndarray:
    """A NumPy view of host tensor ``tensor`` (bfloat16 as its raw bits: int16)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


class ChunkFileError(RuntimeError):
    """A disk-tier file is missing, truncated or does not hold what was written."""


class DiskTier:
    """A private directory under ``root`` holding chunk streams as ``.npy`` files."""

    def __init__(self, root: str | Path, *, label: str) -> None:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"tessera-chunks-{label}-", dir=root))
        self._crc: dict[tuple[int, str], tuple[int, int]] = {}
        self._pending: dict[tuple[int, str], tuple[int, int]] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self._count = threading.Lock()  # the prefetch and early-step threads read and write too

    def path(self, chunk: int, stream: str, *, pending: bool = False) -> Path:
        """The file of one stream of one chunk (``pending``: of its uncommitted next value)."""
        return self.dir / f"chunk-{chunk:06d}-{stream}{'.next' if pending else ''}.npy"

    def write(self, chunk: int, stream: str, tensor: Tensor, *, pending: bool = False) -> None:
        """Write ``tensor`` (1-D, on the host) as the stream's file, atomically (temp + replace);
        ``pending``: as its next value, which ``commit`` makes the stream."""
        array = _numpy(tensor.detach().contiguous())
        data = array.data.cast("B")
        path = self.path(chunk, stream, pending=pending)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_header(array))
            f.write(data)
        os.replace(tmp, path)
        (self._pending if pending else self._crc)[(chunk, stream)] = (zlib.crc32(data), array.size)
        with self._count:
            self.bytes_written += data.nbytes

    def commit(self, chunk: int, stream: str) -> None:
        """Make the stream's pending value (``write(..., pending=True)``) the stream."""
        crc = self._pending.pop((chunk, stream), None)
        if crc is None:
            raise ChunkFileError(f"chunk {chunk} stream {stream!r} has no pending value to commit")
        os.replace(self.path(chunk, stream, pending=True), self.path(chunk, stream))
        self._crc[(chunk, stream)] = crc

    def uncache(self, chunk: int, stream: str) -> None:
        """Ask the kernel to drop the stream's file from the page cache (its bytes stay on disk):
        a stream read for the last time before a pending value replaces it, so the page cache
        does not hold both."""
        fd = os.open(self.path(chunk, stream), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def drop_pending(self, chunk: int, stream: str) -> None:
        """Forget the stream's pending value (its file is removed); the stream is unchanged."""
        self._pending.pop((chunk, stream), None)
        self.path(chunk, stream, pending=True).unlink(missing_ok=True)

    def read_into(self, chunk: int, stream: str, out: Tensor) -> None:
        """Fill host tensor ``out`` from the stream's file, checking header, length and CRC."""
        path = self.path(chunk, stream)
        expected = self._crc.get((chunk, stream))
        if expected is None:
            raise ChunkFileError(f"chunk {chunk} stream {stream!r} was never written to the disk tier")
        if not path.exists():
            raise ChunkFileError(
                f"chunk {chunk} stream {stream!r}: {path} is missing (was the disk tier directory changed?)"
            )
        array = _numpy(out)
        header = _header(array)
        with open(path, "rb") as f:
            head = f.read(len(header))
            got = f.readinto(array.data.cast("B")) if head == header else 0
        if head != header:
            raise ChunkFileError(
                f"chunk {chunk} stream {stream!r}: {path} is corrupt (its header {head[:64]!r} is not the "
                f".npy header of {array.dtype} {array.shape})"
            )
        if got != array.nbytes:
            raise ChunkFileError(
                f"chunk {chunk} stream {stream!r}: {path} is truncated ({got} of {array.nbytes} data bytes)"
            )
        crc = zlib.crc32(array.data.cast("B"))
        if crc != expected[0]:
            raise ChunkFileError(
                f"chunk {chunk} stream {stream!r}: {path} does not hold what was written "
                f"(CRC-32 {crc:#010x}, expected {expected[0]:#010x})"
            )
        with self._count:
            self.bytes_read += array.nbytes

    def read(
        self, chunk: int, stream: str, numel: int, *, pin: bool, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """A new host tensor of ``dtype`` holding the stream (pinned when ``pin``)."""
        out = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.read_into(chunk, stream, out)
        return out

    def drop(self, chunk: int, stream: str) -> None:
        """Forget a stream (its file is removed)."""
        self._crc.pop((chunk, stream), None)
        self.path(chunk, stream).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the directory and everything in it."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self._crc.clear()
        self._pending.clear()
