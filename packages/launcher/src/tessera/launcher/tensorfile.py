"""Safetensors files read one tensor at a time: ``LazyTensors`` is a read-only mapping over
several files whose values are read on access (``tessera.comm.safefile.SafeFile``, the one
reader of headers and tensors), so loading a checkpoint of a model larger than memory never
holds it whole. (Writing one tensor at a time is ``tessera.comm.safefile.StreamWriter``.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from torch import Tensor

from tessera.comm.safefile import SafeFile

__all__ = ["LazyTensors"]


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
