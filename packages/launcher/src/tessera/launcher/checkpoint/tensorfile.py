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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from tessera.comm.safefile import SafeFile
from tessera.launcher.checkpoint.exported import Band, ExportPart

__all__ = ["INDEX", "LazyTensors", "Renamed", "Renames", "weight_files"]

INDEX = "model.safetensors.index.json"  # Hugging Face's index of a sharded checkpoint
# a column band is read one row at a time when a row's part is at least this long: below it,
# reading the rows whole and cutting them costs less than one read call per row
MIN_RUN_BYTES = 4096


class Renamed(NamedTuple):
    """A checkpoint's tensor as the model knows it: its ``name`` there, and whether the file
    holds it ``transposed`` (a matrix that transformers transposes as it loads it)."""

    name: str
    transposed: bool = False


class Renames(Protocol):
    """How a foreign checkpoint's tensor names read as the model's (a Hugging Face family's
    loading renames: `tessera.launcher.families.hf_names`)."""

    def read(self, stored: str) -> Renamed:
        """The checkpoint's tensor ``stored`` as the model knows it (its own name when not renamed)."""
        ...

    def unread(self, stored: Iterable[str]) -> str:
        """Why some of the checkpoint's tensors ``stored`` cannot be read as they are (a
        transformation on load that import does not make), for an error; "" when none."""
        ...

    def parts(self, name: str) -> tuple[ExportPart, ...]:
        """The parts of the checkpoint's tensors (by their names as renamed) that make the model's
        tensor ``name``, where transformers splits one on load (a fused ``query_key_value``:
        its band of rows); () where none."""
        ...


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
    access; ``rename``: how each stored tensor is known here (`Renamed`: a family's loading
    renames, `tessera.launcher.families.hf_names`), ValueError naming two stored tensors it
    gives one name. Close it (or use it as a context manager) to release the files."""

    def __init__(
        self, paths: Sequence[str | os.PathLike[str]], rename: Callable[[str], Renamed] | None = None
    ) -> None:
        self._files = [SafeFile(Path(p)) for p in paths]
        self._where: dict[str, SafeFile] = {}
        self._stored: dict[str, str] = {}  # a renamed tensor's name here -> its name in its file
        self._transposed: set[str] = set()  # tensors the file holds transposed, by name here
        seen: dict[str, str] = {}
        for f in self._files:
            for stored in f.entries:
                name, transposed = (stored, False) if rename is None else rename(stored)
                other = seen.setdefault(name, stored)
                if other != stored:
                    both = " and ".join(sorted((other, stored)))
                    raise ValueError(f"{f.path}: {both} both read as {name}")
                if name != stored:
                    self._stored[name] = stored
                if transposed:
                    self._transposed.add(name)
                self._where[name] = f

    def _entry(self, name: str) -> tuple[SafeFile, str]:
        return self._where[name], self._stored.get(name, name)

    def stored(self, name: str) -> str:
        """Tensor ``name``'s name in its file (``name`` itself when not renamed)."""
        return self._stored.get(name, name)

    def transposed(self, name: str) -> bool:
        """Whether the file holds tensor ``name`` transposed (``Renamed.transposed``)."""
        return name in self._transposed

    def metadata(self, index: int = 0) -> dict[str, str]:
        """The ``__metadata__`` of the ``index``-th file."""
        return dict(self._files[index].metadata)

    def __getitem__(self, name: str) -> Tensor:
        safe, stored = self._entry(name)
        with open(safe.path, "rb") as f:
            return safe.read(f, stored)

    def read_part(self, name: str, first: tuple[int, int] | None = None, band: Band | None = None) -> Tensor:
        """Tensor ``name`` (a stacked bank, a matrix or a vector) cut to ``first[0]:first[1]``
        along its first dimension (None: all) and to ``band`` (`Band`; None: all). Rows
        ``start:stop`` (a band of dim -2, step 1, of a tensor of 3 or more dimensions) are read
        alone: one run, or one per row block; so are columns ``start:stop`` (dim -1, step 1)
        when each row's run is at least `MIN_RUN_BYTES`: one run per row; a matrix's rows are its
        first dimension's slice (one run). Any other band is cut after reading the first
        dimension's slice whole (one run). ValueError naming the tensor when the cut is not
        within it."""
        safe, name = self._entry(name)
        shape, dtype = tuple(safe.entries[name].shape), safe.entries[name].dtype
        if first is None and band is not None and len(shape) == 2 and band.dim == -2 and band.step == 1:
            first, band = (band.start, band.stop), None  # a matrix's rows: its first dimension's slice
        a0, a1 = first if first is not None else (0, shape[0] if shape else 0)
        rows = band is not None and band.dim == -2 and band.step == 1 and len(shape) >= 3
        rows = rows and band is not None and (band.start, band.stop) != (0, shape[-2])  # else one run
        within = band is None or (len(shape) >= -band.dim and band.stop <= shape[band.dim])
        if len(shape) == 1 and first is None and band is not None and band.dim == -1 and within:
            with open(safe.path, "rb") as f:  # a vector's band (a bias split on load): read whole, cut
                return band.cut(safe.read(f, name)).contiguous()
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
        safe, stored = self._entry(name)
        return tuple(safe.entries[stored].shape)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of tensor ``name``, from its file's header (nothing is read)."""
        safe, stored = self._entry(name)
        return safe.entries[stored].dtype

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Release the files."""
        self._where.clear()
        self._stored.clear()
        self._files.clear()

    def __enter__(self) -> LazyTensors:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
