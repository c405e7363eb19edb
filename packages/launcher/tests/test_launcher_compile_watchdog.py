"""A compile is progress, not a hang: the watchdog's phases.

Tier 0, the watchdog's verdicts on beats: a rank in the ``compiling`` phase is judged by
``train.compile_watchdog_s``, before or after its first step; a compile on the node is
progress for the ranks that wait for it; the end of a compile restarts the clock.

Tier 3, real ``tessera run`` launches (two ranks, loopback): rank 0's compiles (dynamo, and
AOT autograd's lazy backward, through a compiler that sleeps) outlast ``train.watchdog_s``
after the first step while rank 1 waits for it in a collective, and the job finishes; a
compile that never ends is ended after ``train.compile_watchdog_s``, naming the phase and the
compiling rank only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.launcher.run.heartbeat import compiling
from tessera.launcher.run.watchdog import Beat, Watchdog, read_beats, write_beat

COMPILING = compiling(30.0)


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    procs = [
        subprocess.Popen(["sleep", "60"]) for _ in range(8)
    ]  # stand-ins for ranks (a verdict kills them)
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def test_a_compile_is_progress_under_its_own_limit(tmp_path: Path, sleepers: list[int]) -> None:
    def beats(now: float, pids: list[int]) -> list[Beat]:
        return [
            Beat(0, pids[0], now - 0.5, step=1, step_time=80.0, phase=COMPILING, phase_time=90.0),
            Beat(1, pids[1], now - 0.5, step=1, step_time=80.0),  # waits for rank 0 in a collective
        ]

    for b in beats(100.0, sleepers):
        write_beat(tmp_path, b)
    assert read_beats(tmp_path) == beats(100.0, sleepers)
    dog = Watchdog(tmp_path, timeout_s=5)
    assert dog.check(beats(119.0, sleepers), now=119.0) == []  # 39 s without a step, 29 s compiling
    lines = dog.check(beats(121.0, sleepers), now=121.0)
    assert (
        lines[0]
        == "watchdog: no progress for 30 s while compiling (train.compile_watchdog_s); ending the job"
    )
    named = f"rank 0 (pid {sleepers[0]}) hung: compiling for 31.0 s, last step 1, 41.0 s ago"
    assert any(named in line for line in lines), lines
    assert not any("rank 1 " in line for line in lines), lines


def test_a_hang_in_a_first_compile_ends_and_a_compile_ending_is_a_step(
    tmp_path: Path, sleepers: list[int]
) -> None:
    def first(now: float) -> list[Beat]:  # before any step: rank 0 compiles since 10, rank 1 waits
        return [
            Beat(0, sleepers[0], now - 0.5, 0, None, phase=COMPILING, phase_time=10.0),
            Beat(1, sleepers[1], now - 0.5, 0, None),
        ]

    def ended(now: float) -> list[Beat]:  # rank 0 left its compile at 95; both last stepped at 80
        return [
            Beat(0, sleepers[2], now - 0.5, 1, 80.0, phase=None, phase_time=95.0),
            Beat(1, sleepers[3], now - 0.5, 1, 80.0),
        ]

    dog = Watchdog(tmp_path, timeout_s=5)
    assert dog.check(first(39.0), now=39.0) == []
    lines = dog.check(first(41.0), now=41.0)
    assert lines[0].endswith("while compiling (train.compile_watchdog_s); ending the job"), lines
    assert any("rank 0 " in line and "no optimizer step yet" in line for line in lines), lines
    assert dog.check(ended(99.0), now=99.0) == []
    lines = dog.check(ended(100.5), now=100.5)
    assert lines[0] == "watchdog: no progress for 5 s (train.watchdog_s); ending the job"
    assert "every rank is waiting" in lines[1]
    unlimited = [Beat(0, sleepers[4], 1e6, 0, None, phase=compiling(0.0), phase_time=0.0)]
    assert dog.check(unlimited, now=1e6) == []  # train.compile_watchdog_s = 0: no limit


SCRIPT = """
import sys, time
import torch, torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

dist.init_process_group("gloo")
rank, mode = dist.get_rank(), sys.argv[1]


def slow_compiler(gm, example_inputs):
    time.sleep(5 if mode == "slow" else 100_000)  # inside torch's compile
    return make_boxed_func(gm.forward)


model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
compiled = torch.compile(model, backend=aot_autograd(fw_compiler=slow_compiler, bw_compiler=slow_compiler))


def step(forward):
    forward(torch.ones(1, 2)).sum().backward()  # rank 0 compiles the forward, then the backward
    for p in model.parameters():
        dist.all_reduce(p.grad)  # rank 1 waits here for rank 0
    opt.step()
    opt.zero_grad()


if mode == "slow":
    step(model)  # from this step on, train.watchdog_s judges rank 1's progress and rank 0's
for _ in range(2):
    step(compiled if rank == 0 else model)
open(f"done{rank}", "w").write("ok")
"""


def _run(job: Path, mode: str, *settings: str) -> subprocess.CompletedProcess[str]:
    (job / "job.py").write_text(SCRIPT)
    sets = [arg for s in ("parallel.dp=2", "train.watchdog_s=3", *settings) for arg in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "tessera.launcher.run.cli", "run", *sets, "job.py", mode],
        cwd=job,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.slow
def test_compiles_longer_than_the_watchdog_finish(tmp_path: Path) -> None:
    done = _run(tmp_path, "slow")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "watchdog" not in out, out
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()


@pytest.mark.slow
def test_a_hang_in_a_compile_ends_after_its_own_limit(tmp_path: Path) -> None:
    done = _run(tmp_path, "hang", "train.compile_watchdog_s=8")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert (
        "watchdog: no progress for 8 s while compiling (train.compile_watchdog_s); ending the job" in out
    ), out
    assert "watchdog: rank 0 " in out and "hung: compiling for" in out, out
    assert "in slow_compiler" in out, out  # rank 0's Python stack
    assert "watchdog: rank 1 " not in out, out  # it waited for rank 0's compile
