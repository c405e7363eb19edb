"""Bytes between ranks: a small all-gather of byte strings, and files streamed rank to rank.

For what is not a tensor: which files a rank's disk holds, checksums as JSON, a file that one
node has and another needs. ``all_gather_bytes`` is two all-gathers (the lengths, then the
bytes padded to the longest). ``send_file`` / ``recv_file`` move one file in pieces of
``piece_bytes``, so neither side holds more than one piece; the receiver writes it atomically
(``files.publish``), so a broken transfer leaves no half file under the target name.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tessera.comm.collectives import Group, all_gather, group_size
from tessera.comm.files import publish
from tessera.comm.p2p import recv, send

__all__ = ["PIECE_BYTES", "all_gather_bytes", "recv_file", "send_file"]

PIECE_BYTES = 16 << 20
"""How much of a file travels in one message."""


def all_gather_bytes(data: bytes, group: Group = None, device: torch.device | None = None) -> list[bytes]:
    """Every rank's ``data`` in group rank order (collective)."""
    n = group_size(group)
    where = device if device is not None else torch.device("cpu")
    lengths = all_gather(torch.tensor([len(data)], dtype=torch.int64, device=where), group).cpu().tolist()
    longest = max(1, max(lengths))
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = all_gather(mine.to(where), group).cpu().view(n, longest)
    return [bytes(rows[r, : lengths[r]].numpy().tobytes()) for r in range(n)]


def send_file(
    path: str | os.PathLike[str], peer: int, group: Group = None, piece_bytes: int = PIECE_BYTES
) -> int:
    """Send the file at ``path`` to ``peer``, which runs ``recv_file``; the bytes sent."""
    size = Path(path).stat().st_size
    send(torch.tensor([size], dtype=torch.int64), peer, group)
    with open(path, "rb") as f:
        while piece := f.read(piece_bytes):
            send(torch.frombuffer(bytearray(piece), dtype=torch.uint8), peer, group)
    return size


def recv_file(
    path: str | os.PathLike[str], peer: int, group: Group = None, piece_bytes: int = PIECE_BYTES
) -> int:
    """Receive what ``peer``'s ``send_file`` sends into a new file at ``path`` (atomically:
    written beside it, then renamed); the bytes received."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    size = int(recv(torch.zeros(1, dtype=torch.int64), peer, group).item())
    tmp = target.with_name(f".{target.name}.recv-{os.getpid()}")
    with open(tmp, "wb") as f:
        left = size
        while left:
            k = min(piece_bytes, left)
            f.write(recv(torch.empty(k, dtype=torch.uint8), peer, group).numpy().tobytes())
            left -= k
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, target)
    return size
