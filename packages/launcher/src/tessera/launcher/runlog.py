"""A run folder: metrics as JSON lines, a progress line on rank 0, a loss and throughput plot.

Only rank 0 writes. ``Progress`` draws a one-line bar on a terminal (``\\r`` updates) and
falls back to one log line per update elsewhere (CI logs, files).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tessera.comm.files import atomic_write

__all__ = [
    "MetricsWriter",
    "Progress",
    "plot_metrics",
    "read_metrics",
    "truncate_metrics",
]

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (flushed each time, so a crash keeps it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, **record: Any) -> None:
        """Write one record."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> int:
    """Keep only the records up to ``step`` (a run resumed there writes the rest again);
    returns how many were dropped. Atomic; a missing file is left missing."""
    if not path.exists():
        return 0
    records = read_metrics(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if len(kept) != len(records):
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return len(records) - len(kept)


class Progress:
    """``step/total [bar] loss tokens/s eta`` on one line of ``stream``."""

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.tty = self.stream.isatty() and os.environ.get("TERM") != "dumb"

    def update(self, step: int, **values: float) -> None:
        """Show progress after ``step`` steps with the given figures."""
        done = step / max(1, self.total)
        filled = int(done * self.width)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(step, 1) * (self.total - step)
        figures = "  ".join(f"{k} {v:.4g}" for k, v in values.items())
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{step:>5}/{self.total} [{bar}] {figures}  eta {eta:4.0f}s"
        if self.tty:
            end = "\n" if step >= self.total else ""
            self.stream.write(f"\r{line}{end}")
            self.stream.flush()
        else:
            log.info(line)


def plot_metrics(records: list[dict[str, Any]], path: Path) -> None:
    """Training and validation loss, and tokens/s, against step, as a PNG.

    A ``serial_tokens_per_s`` record (the single-process reference of the same model) is drawn
    as a dashed line on the tokens/s axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax_loss.set_ylabel("loss (nats/char)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    speed = [r for r in train if "tokens_per_s" in r]
    ax_speed.plot(
        [r["step"] for r in speed], [r["tokens_per_s"] for r in speed], color="tab:green", label="this run"
    )
    for r in records:
        if "serial_tokens_per_s" in r:
            threads = r.get("threads")
            where = f", {threads} threads" if threads else ""
            label = f"single process (PyTorch{where})"
            ax_speed.axhline(r["serial_tokens_per_s"], color="tab:gray", linestyle="--", label=label)
            ax_speed.legend()
            break
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_xlabel("step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
