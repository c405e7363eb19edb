"""A run folder: metrics as JSON lines, a progress line on rank 0, a loss and throughput plot.

Only rank 0 writes. ``Progress`` draws a one-line bar on a terminal (``\\r`` updates) and
falls back to one log line per update elsewhere (CI logs, files). When the ``tensorboard``
package is importable (the launcher's ``tensorboard`` extra), ``MetricsWriter`` also writes
the records' scalars as TensorBoard event files (``torch.utils.tensorboard``) into a folder
of the run (``TAGS``: loss, learning rate, gradient norm, tokens/s, validation loss, the
single-process reference, a mixture of experts' dropped fraction, and each expert's share of
the routed tokens as ``moe/expert_<e>_share``); without it, one log line says so and nothing
else changes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tessera.comm.files import atomic_write

__all__ = [
    "TAGS",
    "MetricsWriter",
    "Progress",
    "have_tensorboard",
    "plot_metrics",
    "read_metrics",
    "truncate_metrics",
]

log = logging.getLogger(__name__)

# a record's field -> its TensorBoard tag (the fields the main job writes to metrics.jsonl)
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "val_loss": "val/loss",
    "serial_tokens_per_s": "reference/serial_tokens_per_s",
    "dropped_fraction": "moe/dropped_fraction",
}
_said_absent = False


def have_tensorboard() -> bool:
    """Whether the ``tensorboard`` package (which ``torch.utils.tensorboard`` needs) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (flushed each time, so a crash keeps it).

    ``board``: a folder for TensorBoard event files of the same records (each field of
    ``TAGS`` at the record's ``step``, flushed each time), written when the ``tensorboard``
    package is importable; a resumed run passes its step as ``purge_step``, so TensorBoard
    hides the events of the steps it writes again."""

    def __init__(self, path: Path, *, board: Path | None = None, purge_step: int = 0) -> None:
        global _said_absent
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")
        self._board: Any = None
        if board is not None and have_tensorboard():
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(str(board), purge_step=purge_step or None)
            log.info("TensorBoard event files in %s (tensorboard --logdir %s)", board, board)
        elif board is not None and not _said_absent:
            _said_absent = True
            log.info(
                "no TensorBoard event files: the tensorboard package is not installed (pip install "
                "tensorboard, or the launcher's tensorboard extra); metrics go to %s",
                path,
            )

    def write(self, **record: Any) -> None:
        """Write one record."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._board is not None:
            step = int(record.get("step", 0))
            for field, tag in TAGS.items():
                value = record.get(field)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._board.add_scalar(tag, float(value), step)
            for e, share in enumerate(record.get("expert_share") or []):
                self._board.add_scalar(f"moe/expert_{e}_share", float(share), step)
            self._board.flush()

    def close(self) -> None:
        """Close the file (and the event file)."""
        self._file.close()
        if self._board is not None:
            self._board.close()


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
    as a dashed line on the tokens/s axis. Records with ``expert_share`` (a mixture of experts)
    add a third panel: each expert's share of the routed tokens and the dropped fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    load = [r for r in train if r.get("expert_share")]
    fig, axes = plt.subplots(3 if load else 2, 1, figsize=(7, 9 if load else 6), sharex=True)
    ax_loss, ax_speed = axes[0], axes[1]
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
    ax_speed.grid(alpha=0.3)
    if load:
        _plot_expert_load(axes[2], load)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _plot_expert_load(ax: Any, load: list[dict[str, Any]]) -> None:
    """Each expert's share of the routed tokens (uniform: 1 / experts, dotted) and the
    fraction of assignments dropped for capacity, against step."""
    steps = [r["step"] for r in load]
    experts = len(load[0]["expert_share"])
    for e in range(experts):
        ax.plot(steps, [r["expert_share"][e] for r in load], label=f"expert {e}")
    ax.axhline(1 / experts, color="tab:gray", linestyle=":", label="uniform")
    ax.plot(steps, [r.get("dropped_fraction", 0.0) for r in load], "k--", label="dropped fraction")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("share of routed tokens")
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
