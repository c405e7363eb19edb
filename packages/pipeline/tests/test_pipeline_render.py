"""Rendering: the PNG is well formed and the Chrome trace has one event per compute action."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from tessera.pipeline import Costs, build_schedule, chrome_trace, simulate, timeline_png
from tessera.pipeline.render import encode_png


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        out.append((tag, body))
        pos += 12 + length
    return out


@pytest.mark.parametrize(("name", "p", "m"), [("zbv", 3, 6), ("interleaved-1f1b", 2, 4)])
def test_timeline_png(tmp_path: Path, name: str, p: int, m: int) -> None:
    result = simulate(build_schedule(name, p, m), Costs(f=1, b=1, w=1, p2p_latency=0.1))
    path = tmp_path / "timeline.png"
    timeline_png(result, path, width=300, row_height=10, margin=2)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    parts = chunks(data)
    assert [tag for tag, _ in parts] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", parts[0][1])
    assert (width, height, depth, colour) == (300, 2 * 2 + p * 10, 8, 2)
    raw = zlib.decompress(parts[1][1])
    assert len(raw) == height * (1 + 3 * width)
    assert raw[:: 1 + 3 * width] == b"\x00" * height  # filter 0 on every row
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.png"]  # no temp left


def test_chrome_trace(tmp_path: Path) -> None:
    result = simulate(build_schedule("zb-h1", 4, 8))
    path = tmp_path / "trace.json"
    chrome_trace(result, path)
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    computes = result.compute_actions()
    assert len(spans) == len(computes) == 4 * 8 * 3
    assert {e["pid"] for e in spans} == set(range(4))
    first = min(spans, key=lambda e: (e["pid"], e["ts"]))
    assert (first["name"], first["ts"], first["dur"]) == ("F0s0", 0.0, 1e6)
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(result.makespan * 1e6)
    names = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in names] == [f"rank {r}" for r in range(4)]


def test_encode_png_checks_rows() -> None:
    assert encode_png(1, 1, [b"\x00\x00\x00"]).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="expected 3"):
        encode_png(1, 1, [b"\x00"])
    with pytest.raises(ValueError, match="got 2 rows for height 1"):
        encode_png(1, 1, [b"\x00" * 3] * 2)
