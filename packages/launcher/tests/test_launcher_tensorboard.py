"""TensorBoard event files beside metrics.jsonl (``runlog.MetricsWriter(board=...)``).

With the optional ``tensorboard`` package: every scalar of ``runlog.TAGS`` a record holds
reads back from the event files at its step (values as float32, TensorBoard's scalar type:
compared exactly after rounding to it), booleans and missing values are not written, and a
resumed writer's ``purge_step`` hides the steps it writes again. Without the package
(``have_tensorboard`` patched to False): metrics.jsonl is byte for byte what it is with no
board, no folder appears, and one log line says so for any number of writers. Tier 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.launcher.job import runlog
from tessera.launcher.job.runlog import TAGS, MetricsWriter

RECORDS: list[dict[str, Any]] = [
    {"step": 0, "serial_tokens_per_s": 12345.6, "threads": 2},
    {"step": 1, "loss": 4.25, "lr": 3e-3, "grad_norm": 1.75, "tokens_per_s": 999.5, "skipped": False},
    {"step": 2, "loss": 3.5, "lr": 2e-3, "grad_norm": None, "tokens_per_s": 1001.25, "skipped": True},
    {"step": 2, "val_loss": 3.75},
    {"step": 3, "loss": 3.125, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1002.0, "skipped": False},
]


def _scalars(board: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in ``board``: (step, value) in step order."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(board))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for field, tag in TAGS.items():
            if isinstance(r.get(field), float):
                out.setdefault(tag, []).append((r["step"], float(np.float32(r[field]))))
    return out


def test_the_records_scalars_read_back_from_the_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is absent")
    board = tmp_path / "tensorboard"
    writer = MetricsWriter(tmp_path / "metrics.jsonl", board=board)
    for r in RECORDS:
        writer.write(**r)
    got = _scalars(board)  # read while the writer is open: each write is flushed
    writer.close()
    assert got == _expected(RECORDS)
    assert len(list(board.glob("events.out.tfevents.*"))) == 1


def test_a_resumed_writer_hides_the_steps_it_writes_again(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is absent")
    board = tmp_path / "tensorboard"
    first = MetricsWriter(tmp_path / "metrics.jsonl", board=board)
    for step in range(1, 5):
        first.write(step=step, loss=10.0 + step)
    first.close()
    resumed = MetricsWriter(tmp_path / "metrics.jsonl", board=board, purge_step=3)
    for step in range(3, 6):
        resumed.write(step=step, loss=20.0 + step)
    resumed.close()
    assert _scalars(board)["train/loss"] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]


def test_without_tensorboard_nothing_changes_and_one_line_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runlog, "have_tensorboard", lambda: False)
    monkeypatch.setattr(runlog, "_said_absent", False)
    plain = MetricsWriter(tmp_path / "plain.jsonl")
    for r in RECORDS:
        plain.write(**r)
    plain.close()
    with caplog.at_level(logging.INFO, logger="tessera.launcher.job.runlog"):
        for name in ("a", "b"):
            writer = MetricsWriter(tmp_path / f"{name}.jsonl", board=tmp_path / f"board-{name}")
            for r in RECORDS:
                writer.write(**r)
            writer.close()
    for name in ("a", "b"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
        assert not (tmp_path / f"board-{name}").exists()
    said = [
        r.getMessage() for r in caplog.records if "tensorboard package is not installed" in r.getMessage()
    ]
    assert len(said) == 1 and "pip install tensorboard" in said[0], said
