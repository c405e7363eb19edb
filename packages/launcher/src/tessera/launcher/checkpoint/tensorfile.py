"""Safetensors files read one tensor at a time: ``LazyTensors`` is a read-only mapping over
several files whose values (or a part of one, ``read_part``) are read on access
(``tessera.comm.safefile.SafeFile``, the one reader of headers and tensors), so loading a
checkpoint of a model larger than memory never holds it whole. (Writing one tensor at a
time is ``tessera.comm.safefile.StreamWriter``.)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import torch
from torch import Tensor

from tessera.comm.safefile import SafeFile
from tessera.launcher.checkpoint.exported import Band

__all__ = ["INDEX", "LazyTensors", "weight_files"]

INDEX = "model.safetensors.index.json"  # Hugging Face's index of a sharded checkpoint
# a column band is read one row at a time when a row's part is at least this long: below it,
# reading the rows whole and cutting them costs less than one read call per row
MIN_RUN_BYTES = 4096


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint: ``path`` itself if it is a file; for a
    directory (or an index file), the shards its ``model.safetensors.index.json`` names, else
    its ``model.safetensors``. ValueError naming what is missing."""
    path = Path(path)
    index = path / INDEX if path.is_dir() else path if path.name.endswith(".index.json") else None
    if index is None:
        return [path]
    if not index.is_file():
        single = path / "model.safetensors"
        if path.is_dir() and single.is_file():
            return [single]
        raise ValueError(f"{path} holds neither {INDEX} nor model.safetensors")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index} names shards that are missing: {', '.join(missing[:3])}")
    return files


class LazyTensors(Mapping[str, Tensor]):
    """The tensors of ``paths`` by name (a name in two files: the later file's), each read on
    access. Close it (or use it as a context manager) to release the files."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        self._files = [SafeFile(Path(p)) for p in paths]
        self._where: dict[str, SafeFile] = {name: f for f in self._files for name in f.entries}

    def metadata(self, index: int = 0) -> dict[str, str]:
        """The ``__metadata__`` of the ``index``-th file."""
        return dict(self._files[index].metadata)

    def __getitem__(self, name: str) -> Tensor:
        safe = self._where[name]
        with open(safe.path, "rb") as f:
            return safe.read(f, name)

    def read_part(self, name: str, first: tuple[int, int] | None = None, band: Band | None = None) -> Tensor:
        """Tensor ``name`` (of 2 or more dimensions: a stacked bank) cut to ``first[0]:first[1]``
        along its first dimension (None: all) and to ``band`` (`Band`; None: all). Rows
        ``start:stop`` (a band of dim -2, step 1, of a tensor of 3 or more dimensions) are read
        alone: one run, or one per row block; so are columns ``start:stop`` (dim -1, step 1)
        when each row's run is at least `MIN_RUN_BYTES`: one run per row. Any other band is cut
        after reading the first dimension's slice whole (one run). ValueError naming the tensor
        when the cut is not within it."""
        safe = self._where[name]
        shape, dtype = tuple(safe.entries[name].shape), safe.entries[name].dtype
        a0, a1 = first if first is not None else (0, shape[0] if shape else 0)
        rows = band is not None and band.dim == -2 and band.step == 1 and len(shape) >= 3
        rows = rows and band is not None and (band.start, band.stop) != (0, shape[-2])  # else one run
        within = band is None or (len(shape) > -band.dim and band.stop <= shape[band.dim])
        if len(shape) < 2 or not within or not 0 <= a0 <= a1 <= shape[0]:
            raise ValueError(f"{safe.path}: {name} {list(shape)} has no part {a0}:{a1} x {band}")
        if band is not None and band.dim == -1 and band.step == 1 and len(shape) >= 2:
            run = (band.stop - band.start) * dtype.itemsize
            if band.stop - band.start < shape[-1] and run >= MIN_RUN_BYTES:
                return self._columns(safe, name, shape, dtype, (a0, a1), band)
        if band is None or not rows:  # the first dimension's slice: one run
            out = torch.empty((a1 - a0, *shape[1:]), dtype=dtype)
            if out.numel():
                with open(safe.path, "rb") as f:
                    safe.read_into(f, name, out.view(1, -1)[0], a0 * math.prod(shape[1:]))
            return out if band is None else band.cut(out).contiguous()
        r0, r1 = band.start, band.stop
        inner, height, width = math.prod(shape[1:-2]), shape[-2], shape[-1]
        out = torch.empty((a1 - a0, *shape[1:-2], r1 - r0, width), dtype=dtype)
        if out.numel() == 0:
            return out
        runs = out.view(-1, (r1 - r0) * width)  # one run per row block
        with open(safe.path, "rb") as f:
            for k in range(runs.shape[0]):
                safe.read_into(f, name, runs[k], ((a0 * inner + k) * height + r0) * width)
        return out

    @staticmethod
    def _columns(
        safe: SafeFile,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        first: tuple[int, int],
        band: Band,
    ) -> Tensor:
        """Columns ``band.start:band.stop`` of rows ``first`` of the first dimension: one run per row."""
        (a0, a1), (c0, c1) = first, (band.start, band.stop)
        height, width = math.prod(shape[1:-1]), shape[-1]
        out = torch.empty((a1 - a0, *shape[1:-1], c1 - c0), dtype=dtype)
        runs = out.view(-1, c1 - c0)
        with open(safe.path, "rb") as f:
            for k in range(runs.shape[0]):
                safe.read_into(f, name, runs[k], (a0 * height + k) * width + c0)
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from its file's header (nothing is read)."""
        return tuple(self._where[name].entries[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of tensor ``name``, from its file's header (nothing is read)."""
        return self._where[name].entries[name].dtype

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Release the files."""
        self._where.clear()
        self._files.clear()

    def __enter__(self) -> LazyTensors:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
