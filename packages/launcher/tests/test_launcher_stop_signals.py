"""Tier 3: ``tessera train`` stopped by SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption)
saves a checkpoint generation after the step its ranks agree on, says where in one line and
exits 128 + the signal's number without a traceback; a resume from it goes on in the same run
folder, its metrics appended, and its losses are those of an uninterrupted run bit for bit.

Real processes (2 ranks, dp=2 with ZeRO-1): the signal is sent once rank 0 has logged a step.
The learning rate is constant (no warm-up, ``optim.min_lr_ratio=1``), so a run's schedule does
not depend on ``train.steps``: the interrupted run is given steps it never reaches, the resume
and the uninterrupted run the same few more than the stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

BASE = ["parallel.dp=2", "parallel.microbatches=1", "zero.stage=1", "model.d_model=32", "model.n_layers=2",
        "model.seq_len=16", "data.batch_size=4", "data.max_chars=50000", "optim.warmup_steps=0",
        "optim.min_lr_ratio=1.0", "train.log_every=1", "train.eval_every=1000",
        "train.sample_chars=4"]  # fmt: skip
LINE = re.compile(
    r"tessera: stopped by (SIG\w+) after step (\d+): saved (\S+); resume with --set train\.resume=(\S+)"
)


def _start(where: Path, log: str, *sets: str) -> subprocess.Popen[bytes]:
    """``tessera train`` in ``where``, in a process group of its own (as a shell starts it),
    its output into ``where/log``."""
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train"]
    for s in [*BASE, *sets]:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    with (where / log).open("wb") as out:
        return subprocess.Popen(
            cmd,
            cwd=where,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )


def _wait_for_a_step(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while "/100000 [" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "no step was logged"
        time.sleep(0.05)


def _stopped(proc: subprocess.Popen[bytes], log: Path, code: int) -> tuple[str, int, Path, str]:
    """The exit code and the launcher's last line of a stopped run: (signal, step, generation, resume)."""
    try:
        assert proc.wait(timeout=120) == code, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    match = LINE.fullmatch(text.splitlines()[-1])
    assert match is not None, text[-3000:]
    return match[1], int(match[2]), Path(match[3]), match[4]


def _losses(run: Path) -> list[tuple[int, float]]:
    records: list[dict[str, Any]] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_ctrl_c_saves_a_generation_and_says_where(tmp_path: Path) -> None:
    proc = _start(tmp_path, "run.log", "train.steps=100000", "train.name=run")
    _wait_for_a_step(proc, tmp_path / "run.log")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    name, step, generation, resume = _stopped(proc, tmp_path / "run.log", 130)
    assert name == "SIGINT" and step >= 1
    assert generation == Path("runs/run/checkpoint") / f"step-{step:08d}" and resume == "runs/run/checkpoint"
    manifest = json.loads((tmp_path / generation / "manifest.json").read_text())
    assert manifest["step"] == step
    assert [s for s, _ in _losses(tmp_path / "runs/run")] == list(range(1, step + 1))


def test_sigterm_saves_and_a_resume_goes_on_in_the_same_folder_exactly(tmp_path: Path) -> None:
    proc = _start(tmp_path, "first.log", "train.steps=100000")  # a generated run folder name
    _wait_for_a_step(proc, tmp_path / "first.log")
    os.kill(proc.pid, signal.SIGTERM)  # a scheduler's preemption: the launcher alone
    name, step, generation, resume = _stopped(proc, tmp_path / "first.log", 143)
    (run,) = (tmp_path / "runs").iterdir()
    assert name == "SIGTERM" and resume == f"runs/{run.name}/checkpoint"
    assert generation == Path(resume) / f"step-{step:08d}"
    total = step + 3
    resumed = _start(tmp_path, "resumed.log", f"train.steps={total}", f"train.resume={resume}")
    straight = _start(tmp_path, "straight.log", f"train.steps={total}", "train.name=straight")
    for p, log in ((resumed, "resumed.log"), (straight, "straight.log")):
        assert p.wait(timeout=300) == 0, (tmp_path / log).read_text()[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([run.name, "straight"])
    expected = _losses(tmp_path / "runs/straight")
    assert [s for s, _ in expected] == list(range(1, total + 1))
    assert _losses(run) == expected  # bit for bit, one run in one folder
    records = (run / "metrics.jsonl").read_text()
    assert records.count("serial_tokens_per_s") == 1 and (run / "model.safetensors").is_file()


def test_a_rank_signalled_alone_stops_the_whole_job_the_same_way(tmp_path: Path) -> None:
    """A scheduler may signal the ranks rather than ``tessera``: SIGTERM to rank 1's process
    alone; every rank stops after the same step and the launcher reports it."""
    proc = _start(tmp_path, "run.log", "train.steps=100000", "train.name=run")
    _wait_for_a_step(proc, tmp_path / "run.log")
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 2, children  # the two ranks, started by torch's agent in this process
    os.kill(int(children[-1]), signal.SIGTERM)
    name, step, generation, _ = _stopped(proc, tmp_path / "run.log", 143)
    assert (
        name == "SIGTERM"
        and json.loads((tmp_path / generation / "manifest.json").read_text())["step"] == step
    )
