"""Tier 0: run folders, committed checkpoints, endpoints and the watchdog's verdicts (no job)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.launcher.checkpoint import committed_checkpoint
from tessera.launcher.checkpoint.generations import FORMAT
from tessera.launcher.config import Config, TrainConfig
from tessera.launcher.run.nodes import endpoint_port, is_loopback, slurm_restarts
from tessera.launcher.run.runs import RunFolderError, create_run_folder, requeued, run_folder
from tessera.launcher.run.watchdog import Beat, Watchdog, read_beats, write_beat


def _config(run_dir: Path, **train: str) -> Config:
    return dataclasses.replace(Config(), train=TrainConfig(run_dir=str(run_dir), **train))  # type: ignore[arg-type]


def test_generated_names_never_clash(tmp_path: Path) -> None:
    config = _config(tmp_path)
    folders: list[Path] = []
    threads = [
        threading.Thread(target=lambda: folders.append(create_run_folder(config, now=1e9))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = sorted(f.name for f in folders)
    assert len(set(names)) == 8 and all(f.is_dir() for f in folders)
    assert names[0] == "char-gpt-" + names[0].split("char-gpt-")[1][:15]  # the first has no suffix
    assert {n.rsplit("-", 1)[1] for n in names[1:]} == {str(i) for i in range(2, 9)}


def test_an_explicit_name_is_used_once_unless_resumed_into(tmp_path: Path) -> None:
    assert create_run_folder(_config(tmp_path, name="t")) == tmp_path / "t"
    with pytest.raises(RunFolderError, match=r"train.name='t': .* already exists"):
        create_run_folder(_config(tmp_path, name="t"))
    again = _config(tmp_path, name="t", resume=str(tmp_path / "t" / "checkpoint"))
    assert create_run_folder(again) == tmp_path / "t"
    assert run_folder(Config(), device=None, env={"TESSERA_RUN_FOLDER": "x/y"}) == Path("x/y")  # type: ignore[arg-type]


def test_a_requeued_job_goes_on_in_its_folder_from_its_newest_generation(tmp_path: Path) -> None:
    """SLURM's requeue (``SLURM_RESTART_COUNT`` > 0): the folder of ``train.name`` is taken as it
    is, and ``train.resume`` becomes its checkpoint once it holds a committed generation."""
    assert [slurm_restarts(e) for e in ({}, {"SLURM_RESTART_COUNT": "2"}, {"SLURM_RESTART_COUNT": "x"})] == [
        0,
        2,
        0,
    ]
    config = _config(tmp_path, name="job-7")
    assert requeued(config) == config  # nothing saved yet: it starts again from step 0
    assert create_run_folder(config) == tmp_path / "job-7"
    assert create_run_folder(config, again=True) == tmp_path / "job-7"  # taken as it is
    with pytest.raises(RunFolderError, match="already exists"):
        create_run_folder(config)  # not a requeue: the name is taken
    step = tmp_path / "job-7" / "checkpoint" / "step-00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 4}))
    assert requeued(config).train.resume == str(tmp_path / "job-7" / "checkpoint")
    assert requeued(_config(tmp_path)) == _config(tmp_path)  # no train.name: nothing to find


def test_committed_checkpoints(tmp_path: Path) -> None:
    assert committed_checkpoint(tmp_path / "missing") is None
    assert committed_checkpoint(tmp_path) is None
    gens = tmp_path / "gens"
    for step, committed in ((2, True), (10, True), (12, False)):
        (gens / f"step-{step:08d}").mkdir(parents=True)
        if committed:
            manifest = {"format": FORMAT, "step": step}
            (gens / f"step-{step:08d}" / "manifest.json").write_text(json.dumps(manifest))
    assert committed_checkpoint(gens / "step-00000002") == gens / "step-00000002"  # a generation itself
    assert committed_checkpoint(gens) == gens / "step-00000010"  # step 12 is torn: no manifest
    (gens / "step-00000010" / "manifest.json").write_text('{"format": "x", "step": 10}')
    assert committed_checkpoint(gens) == gens / "step-00000002"  # not of this format: not committed


def test_endpoints() -> None:
    assert is_loopback("127.0.0.1:29500") and is_loopback("localhost:1") and not is_loopback("host0:29500")
    assert endpoint_port("h:29500") == 29500
    with pytest.raises(ValueError, match="HOST:PORT"):
        endpoint_port("h")


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def test_the_watchdog_names_the_frozen_rank_first(tmp_path: Path, sleepers: list[int]) -> None:
    beats = [
        Beat(0, sleepers[0], time=100.0, step=7, step_time=90.0),
        Beat(1, sleepers[1], time=93.0, step=7, step_time=90.0),  # its heartbeat stopped too
        Beat(2, sleepers[2], time=100.0, step=7, step_time=99.0, done=True),
    ]
    for b in beats:
        write_beat(tmp_path, b)
    assert read_beats(tmp_path) == beats
    dog = Watchdog(tmp_path, timeout_s=5)
    assert dog.check(beats, now=94.0) == []
    lines = dog.check(beats, now=100.5)
    assert any(f"rank 1 (pid {sleepers[1]}) hung: last step 7, 10.5 s ago" in line for line in lines), lines
    assert not any("rank 0 " in line or "rank 2 " in line for line in lines), lines


def test_the_watchdog_names_the_rank_behind_or_all(tmp_path: Path, sleepers: list[int]) -> None:
    behind = [Beat(0, sleepers[0], 100.0, 8, 90.0), Beat(1, sleepers[1], 100.0, 7, 89.0)]
    lines = Watchdog(tmp_path, timeout_s=5).check(behind, now=100.2)
    assert any("rank 1 " in line for line in lines) and not any("rank 0 " in line for line in lines), lines
    level = [Beat(0, sleepers[0], 100.0, 8, 90.0), Beat(1, sleepers[2], 100.0, 8, 90.0)]
    lines = Watchdog(tmp_path, timeout_s=5).check(level, now=100.2)
    assert any("every rank is waiting" in line for line in lines), lines


def test_the_nodes_of_one_job_share_a_named_folder(tmp_path: Path) -> None:
    """On a shared disk the nodes' launchers meet in one folder: a joining node (rank > 0) takes
    it as it is; node 0 takes it when it holds nothing but the other node's ``logs/``, and still
    refuses another run's outputs."""
    config = _config(tmp_path, name="job")
    assert create_run_folder(config, joining=True) == tmp_path / "job"
    assert create_run_folder(config) == tmp_path / "job"  # node 0, after node 1
    (tmp_path / "job" / "metrics.jsonl").write_text("{}")
    with pytest.raises(RunFolderError, match="already exists"):
        create_run_folder(config)
