"""Not enough free disk for the disk tier or a checkpoint is refused before spawning, with
the folder and both numbers; within 2x of it is a warning. Only ``shutil.disk_usage`` is
replaced (in this test), so the estimate and the check are the library's own."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig
from tessera.launcher.run.disk_space import MIB, checkpoint_bytes, disk_tier_bytes, model_parameters
from tessera.launcher.run.preflight import preflight


def _config(tmp: Path, **zero: Any) -> Config:
    c = Config(
        parallel=ParallelConfig(dp=2),
        zero=ZeroConfig(stage=1, disk_dir=str(tmp / "disk"), fractions=(0.0, 0.0, 1.0), **zero),
        train=TrainConfig(run_dir=str(tmp / "runs"), checkpoint_every=10),
    )
    return dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=64, d_model=256, n_layers=8))


def _free(monkeypatch: pytest.MonkeyPatch, mib: float) -> None:
    usage = shutil.disk_usage("/")
    fake = type(usage)(usage.total, usage.total - int(mib * MIB), int(mib * MIB))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: fake)


def test_the_estimates_follow_the_model() -> None:
    c = Config()
    m = dataclasses.replace(c.model, vocab_size=64, d_model=256, n_layers=8)
    p = model_parameters(dataclasses.replace(c, model=m))
    layer = 4 * 256 * 256 + 2 * 256 * 1024 + 4 * 256 + 1024 + 256 + 4 * 256
    assert p == 64 * 256 + 64 * 256 + 8 * layer + 2 * 256
    config = dataclasses.replace(c, model=m, zero=ZeroConfig(stage=1, disk_dir="d", fractions=(0, 0.5, 0.5)))
    # AdamW: masters, gradients and two moments (16 bytes) over dp=1, half of it on disk, 2 ranks
    assert disk_tier_bytes(config, 2) == 2 * (p * 16 // 2)
    assert checkpoint_bytes(config) == p * 4 + 2 * p * 12  # rank file + shards + portable


def test_too_little_disk_is_refused_before_spawning_with_both_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path)
    tier, generation = disk_tier_bytes(config, 2) / MIB, checkpoint_bytes(config) / MIB
    assert tier > 20 and generation > 20  # the model is large enough for the numbers to say it
    _free(monkeypatch, 1.0)
    errors = preflight(config, main_job=True, processes=2)
    disk = str(tmp_path / "disk")
    assert (
        f"zero.disk_dir={disk!r}: its disk tier needs about {tier:.1f} MiB, 1.0 MiB are free there" in errors
    )
    runs = str(tmp_path / "runs")
    line = f"train.run_dir={runs!r}: a checkpoint needs about {generation:.1f} MiB, 1.0 MiB are free there"
    assert line in errors, errors


def test_within_twice_the_need_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    need = max(disk_tier_bytes(config, 2), checkpoint_bytes(config)) / MIB
    _free(monkeypatch, need * 1.5)
    with caplog.at_level(logging.WARNING, logger="tessera.launcher.run.disk_space"):
        errors = preflight(config, main_job=True, processes=2)
    assert not [e for e in errors if "MiB are free" in e], errors
    assert any("(within 2x)" in r.getMessage() for r in caplog.records), caplog.records
    _free(monkeypatch, need * 4)
    caplog.clear()
    assert not [e for e in preflight(config, main_job=True, processes=2) if "MiB" in e]
    assert not any("within 2x" in r.getMessage() for r in caplog.records)
