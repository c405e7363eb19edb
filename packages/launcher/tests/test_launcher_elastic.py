"""Tier 3: elastic restart. A rank of the main job is SIGKILLed at a random step; with
``train.max_restarts=1`` every rank restarts, resumes from the newest committed checkpoint
generation (a save torn by the kill is passed over) and the loss curve goes on bit for bit as
in an uninterrupted run; the metrics the killed attempt logged past that generation are
written again, not twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SETTINGS = [
    "parallel.dp=2",
    "parallel.microbatches=1",
    "zero.stage=1",
    "model.d_model=32",
    "model.n_layers=2",
    "model.seq_len=16",
    "data.batch_size=4",
    "data.max_chars=50000",
    "train.steps=8",
    "train.log_every=1",
    "train.eval_every=8",
    "train.checkpoint_every=2",
    "train.sample_chars=10",
    "train.watchdog_s=300",
    "optim.warmup_steps=2",
]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _losses(run: Path) -> list[tuple[int, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _train(cwd: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    """The main job in the background; its console goes to ``cwd/<name>.log`` (a file, not a
    pipe nobody reads while it runs)."""
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train"]
    for item in [*SETTINGS, f"train.name={name}", *extra]:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (cwd / f"{name}.log").open("w")
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def test_a_killed_rank_restarts_and_the_curve_goes_on_bit_for_bit(tmp_path: Path) -> None:
    straight = _train(tmp_path, "straight")
    straight.wait(timeout=300)
    assert straight.returncode == 0, (tmp_path / "straight.log").read_text()
    want = _losses(tmp_path / "runs" / "straight")
    assert [s for s, _ in want] == list(range(1, 9))

    kill_at = random.randint(3, 6)  # a step past the first checkpoint (step 2)
    job = _train(tmp_path, "killed", "train.max_restarts=1")
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:
        if metrics.exists() and any(s >= kill_at for s, _ in _losses(metrics.parent)):
            break
        time.sleep(0.05)
    victims = _children(job.pid)
    assert victims, "no worker process found"
    os.kill(random.choice(victims), signal.SIGKILL)
    job.wait(timeout=300)
    out = (tmp_path / "killed.log").read_text()
    assert job.returncode == 0, f"killed at step {kill_at}:\n{out}"
    assert "(restart 1)" in out, out
    assert _losses(metrics.parent) == want, f"killed at step {kill_at}"
    generations = sorted(p.name for p in (metrics.parent / "checkpoint").glob("step-*"))
    assert generations == ["step-00000006", "step-00000008"], generations  # keep_last=2
