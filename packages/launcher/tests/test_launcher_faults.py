"""Tier 3: faults on real `tessera run` launches (two ranks each, loopback only).

(The launcher SIGKILLed, and an explicit loopback endpoint: in test_launcher_cli.py.)

- One rank SIGSTOPped: the watchdog ends the job (exit 1), naming that rank as stopped.
- One rank hung in Python: the watchdog names it and prints its Python stack.
- The same hang on the first attempt only, with ``train.max_restarts=1``: the watchdog ends
  that attempt and the job restarts and finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
out, mode = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100_000):
    model(torch.ones(1, 2)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    first = os.environ.get("TESSERA_RESTART_COUNT") == "0"
    if (mode == "hang" or (mode == "hang-once" and first)) and rank == 1 and step == 5:
        while True:
            time.sleep(0.1)  # the line the watchdog's stack shows
    if mode == "hang-once" and step == 20:
        break
    opt.step()
    opt.zero_grad()
    if step == 2:
        open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
    time.sleep(0.05)
"""


def _start(job: Path, mode: str, *extra: str) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tessera.launcher.run.cli",
            "run",
            "--set",
            "parallel.dp=2",
            *extra,
            "job.py",
            str(job),
            mode,
        ],
        cwd=job,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while not ((job / "pid0").exists() and (job / "pid1").exists()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    time.sleep(0.2)  # the pid files are complete
    return proc, [int((job / f"pid{r}").read_text()) for r in range(2)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(SCRIPT)
    return tmp_path


def test_a_stopped_rank_is_named_and_the_job_ends(job: Path) -> None:
    proc, workers = _start(job, "train", "--set", "train.watchdog_s=3")
    os.kill(workers[1], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    print(f"job ended {time.monotonic() - stopped:.2f} s after SIGSTOP (train.watchdog_s=3)")
    assert proc.returncode == 1, out
    assert f"rank 1 (pid {workers[1]}) hung" in out and "the process is stopped" in out, out
    assert f"rank 0 (pid {workers[0]}) hung" not in out, out


def test_a_rank_hung_in_python_is_named_with_its_stack(job: Path) -> None:
    proc, workers = _start(job, "hang", "--set", "train.watchdog_s=3")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1, out
    assert f"rank 1 (pid {workers[1]}) hung: last step 5" in out, out
    assert "its Python stack:" in out and 'File "' in out and "job.py" in out, out
    assert not any(_alive(pid) for pid in workers)


def test_a_hang_caught_by_the_watchdog_restarts_the_job(job: Path) -> None:
    proc, workers = _start(job, "hang-once", "--set", "train.watchdog_s=3", "--set", "train.max_restarts=1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert f"rank 1 (pid {workers[1]}) hung: last step 5" in out, out
    assert "restart 1 of 1" in out, out
    assert not any(_alive(pid) for pid in workers)
