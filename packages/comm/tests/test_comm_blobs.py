"""Tier 2: bytes between ranks (``tessera.comm.blobs``) on gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.comm.blobs import all_gather_bytes, recv_file, send_file
from tessera.comm.testing.fixtures import PoolFactory


def _gather(rank: int, parts: list[bytes]) -> list[bytes]:
    return all_gather_bytes(parts[rank])


def test_every_rank_gets_every_ranks_bytes_in_order(worker_pools: PoolFactory) -> None:
    parts = [b"", b"x" * 1000, b"\x00\x01 ends in a zero\x00"]
    assert worker_pools(3).run(_gather, parts) == [parts] * 3


def _move(rank: int, folder: str, piece: int) -> int:
    src, dst = Path(folder) / "src.bin", Path(folder) / "out" / "dst.bin"
    return send_file(src, 1, piece_bytes=piece) if rank == 0 else recv_file(dst, 0, piece_bytes=piece)


@pytest.mark.parametrize(
    ("size", "piece"), [(0, 1000), (1, 1), (4096, 1000), (100_003, 1000), (100_003, 1 << 20)]
)
def test_a_file_arrives_whole_in_pieces_of_any_size(
    worker_pools: PoolFactory, tmp_path: Path, size: int, piece: int
) -> None:
    data = bytes((i * 7 + 3) % 256 for i in range(size))
    (tmp_path / "src.bin").write_bytes(data)
    assert worker_pools(2).run(_move, str(tmp_path), piece) == [size, size]
    assert (tmp_path / "out" / "dst.bin").read_bytes() == data
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["dst.bin"]  # no temporary file left
