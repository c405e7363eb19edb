"""Draw a simulated schedule: a PNG timeline and a Chrome trace (no plotting dependencies).

`timeline_png` draws one row per rank, one box per compute action, coloured by kind (F blue,
B green, W orange, BW teal) and lighter for later microbatches (the shade cycles every 8);
virtual stages after a rank's first are drawn darker. `chrome_trace` writes trace-event JSON
(``ph: "X"`` events, one process per rank) that chrome://tracing and Perfetto open. Both
write atomically: a temporary file in the target folder, fsync, then ``os.replace``.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable

from tessera.comm.files import atomic_write
from tessera.pipeline.actions import ActionKind
from tessera.pipeline.simulate import SimResult, TimedAction

__all__ = ["chrome_trace", "encode_png", "timeline_png"]

_Rgb = tuple[int, int, int]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOURS: dict[ActionKind, _Rgb] = {
    ActionKind.F: (52, 101, 164),
    ActionKind.B: (78, 154, 6),
    ActionKind.W: (245, 121, 0),
    ActionKind.BW: (6, 152, 154),
}
_BACKGROUND: _Rgb = (255, 255, 255)
_ROW: _Rgb = (236, 236, 236)
_EDGE: _Rgb = (40, 40, 40)


def encode_png(width: int, height: int, rows: Iterable[bytes]) -> bytes:
    """Encode 8-bit RGB pixel rows (``3 * width`` bytes each) as a PNG (filter 0, zlib)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(tag + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

    raw = bytearray()
    count = 0
    for row in rows:
        if len(row) != 3 * width:
            raise ValueError(f"row {count} has {len(row)} bytes; expected {3 * width}")
        raw += b"\x00" + row
        count += 1
    if count != height:
        raise ValueError(f"got {count} rows for height {height}")
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        PNG_SIGNATURE
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(bytes(raw), 9))
        + chunk(b"IEND", b"")
    )


def timeline_png(
    result: SimResult,
    path: str | os.PathLike[str],
    *,
    width: int = 1200,
    row_height: int = 24,
    margin: int = 4,
) -> None:
    """Write ``result`` as a PNG timeline: ``width`` pixels wide, one row per rank."""
    if width <= 2 * margin or row_height < 3:
        raise ValueError(f"need width > {2 * margin} and row_height >= 3; got {width}, {row_height}")
    sch = result.schedule
    scale = (width - 2 * margin) / result.makespan if result.makespan > 0 else 0.0
    first_stage = [min(sch.stages_of(r), default=0) for r in range(sch.num_ranks)]
    rows: list[bytes] = []
    blank = bytes(_BACKGROUND) * width
    rows += [blank] * margin
    for r, timed in enumerate(result.timeline):
        line = bytearray(blank)
        line[3 * margin : 3 * (width - margin)] = bytes(_ROW) * (width - 2 * margin)
        for t in timed:
            if not t.action.is_compute:
                continue
            x0 = margin + round(t.start * scale)
            x1 = max(x0 + 1, margin + round(t.end * scale))
            x1 = min(x1, width - margin)
            colour = _shade(t, first_stage[r])
            line[3 * x0 : 3 * x1] = bytes(colour) * (x1 - x0)
            if x1 - x0 > 3:
                line[3 * x0 : 3 * x0 + 3] = bytes(_EDGE)
        pad = bytes(blank[: 3 * margin]) + bytes(_ROW) * (width - 2 * margin)
        pad += blank[: 3 * margin]
        rows += [pad] + [bytes(line)] * (row_height - 2) + [pad]
    rows += [blank] * margin
    png = encode_png(width, len(rows), rows)
    atomic_write(path, png)


def _shade(t: TimedAction, first_stage: int) -> _Rgb:
    base = _COLOURS[t.action.kind]
    light = (t.action.microbatch % 8) / 8 * 0.55  # towards white for later microbatches
    dark = 0.0 if t.action.stage == first_stage else 0.3  # later chunks darker
    r, g, b = (c + (255 - c) * light for c in base)
    return (round(r * (1 - dark)), round(g * (1 - dark)), round(b * (1 - dark)))


def chrome_trace(result: SimResult, path: str | os.PathLike[str], *, us_per_unit: float = 1e6) -> None:
    """Write ``result`` as Chrome trace-event JSON: one ``"X"`` event per compute action.

    Simulated time is multiplied by ``us_per_unit`` to get microseconds (default: the costs
    are seconds). Each rank is a process (``pid`` = rank) named ``"rank r"``.
    """
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        for r in range(result.schedule.num_ranks)
    ]
    for t in result.compute_actions():
        events.append(
            {
                "name": str(t.action),
                "cat": str(t.action.kind),
                "ph": "X",
                "pid": t.rank,
                "tid": 0,
                "ts": t.start * us_per_unit,
                "dur": (t.end - t.start) * us_per_unit,
                "args": {"microbatch": t.action.microbatch, "stage": t.action.stage},
            }
        )
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    atomic_write(path, json.dumps(doc, indent=0).encode())
