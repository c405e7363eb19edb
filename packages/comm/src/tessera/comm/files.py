"""Atomic file writes: what every Tessera checkpoint and artefact is written with."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write", "publish"]


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temp file beside ``path``, are fsynced, renamed over ``path``, and the
    directory is fsynced so the rename survives a crash. Parent directories are created.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, target)


def publish(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Rename the written and fsynced file ``tmp`` over ``target`` and fsync the directory, so
    the rename survives a crash (the last step of ``atomic_write`` and of streamed writers)."""
    os.replace(tmp, target)
    fd = os.open(Path(target).parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
