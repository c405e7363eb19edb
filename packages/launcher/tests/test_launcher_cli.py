"""Tier 3: real `tessera run` launches (two ranks each, a few seconds a launch)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import atexit, os, sys, time
import torch, torch.distributed as dist
from tessera.launcher import load_config

dist.init_process_group("gloo")
rank = dist.get_rank()
out = sys.argv[1]
atexit.register(lambda: open(os.path.join(out, f"atexit{rank}"), "w").write("ran"))
open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
x = torch.ones(1) * (rank + 1)
dist.all_reduce(x)
config = load_config()
open(os.path.join(out, f"rank{rank}"), "w").write(f"{x.item()} {config.train.steps}")
mode = sys.argv[2] if len(sys.argv) > 2 else ""
if mode == "fail" and rank == 1:
    raise ValueError("rank one is broken")
if mode == "sleep":
    time.sleep(120)
dist.barrier()
dist.destroy_process_group()
"""


def _tessera(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.launcher.run.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(SCRIPT)
    return tmp_path


def test_two_ranks_run_with_the_resolved_config(job: Path) -> None:
    proc = _tessera("run", "--set", "parallel.dp=2", "--set", "train.steps=7", "job.py", str(job), cwd=job)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert (job / "rank0").read_text() == "3.0 7" and (job / "rank1").read_text() == "3.0 7"
    assert any((job / "runs" / "logs").rglob("stdout.log")), "per-rank log files are written"
    assert (job / "atexit0").read_text() == (job / "atexit1").read_text() == "ran"  # before os._exit


def test_a_failing_rank_ends_the_job_with_its_traceback(job: Path) -> None:
    proc = _tessera("run", "--set", "parallel.dp=2", "job.py", str(job), "fail", cwd=job)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "ValueError: rank one is broken" in out
    assert "rank      : 1" in out


def test_a_config_mistake_exits_2_before_anything_spawns(job: Path) -> None:
    proc = _tessera("run", "--set", "parallel.dp=2", "--set", "zero.stage=7", "job.py", str(job), cwd=job)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines() == ["tessera: zero.stage=7 must be 0, 1, 2 or 3"]
    assert not (job / "pid0").exists()
    # the main job's [model] is checked for the main job, never for a script with its own model
    proc = _tessera("train", "--dry-run", "--set", "parallel.tp=3", cwd=job)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines() == [
        "tessera: model.n_heads=4 does not split 3 ways (parallel.tp=3)",
        "tessera: model.mlp_ratio * model.d_model = 256 does not split 3 ways (parallel.tp=3)",
    ]
    proc = _tessera("run", "--dry-run", "--set", "parallel.tp=3", "job.py", cwd=job)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    proc = _tessera("run", "--nproc-per-node", "3", "--set", "parallel.dp=2", "job.py", cwd=job)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "--nproc-per-node 3 x 1 node(s): world size 3 != pp*dp*cp*tp = 1*2*1*1 = 2" in out


def test_dry_run_prints_commands_and_rank_table(job: Path) -> None:
    proc = _tessera("run", "--dry-run", "--set", "parallel.dp=2", "--set", "parallel.tp=2", "job.py", cwd=job)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "torch.distributed.run --nproc-per-node=4" in out
    assert "rank  node  local  pp  dp  cp  tp" in out
    assert out.strip().splitlines()[-1].split() == ["3", "0", "3", "0", "1", "0", "1"]


def _listening_addresses(pids: list[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(c) for c in text)
    return out


def _sleeping_job_on_loopback(job: Path, *flags: str) -> tuple[subprocess.Popen[str], list[int]]:
    """Start two ranks that sleep; check that every socket of the job listens on loopback."""
    proc = _tessera("run", *flags, "--set", "parallel.dp=2", "job.py", str(job), "sleep", cwd=job)
    deadline = time.monotonic() + 120
    while not ((job / "rank0").exists() and (job / "rank1").exists()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.2)
    workers = [int((job / f"pid{r}").read_text()) for r in range(2)]
    addresses = _listening_addresses([proc.pid, *_children(proc.pid), *workers])
    assert addresses, "the job listens somewhere"
    loopback = {"0100007F", "00000000000000000000000001000000"}
    assert set(addresses) <= loopback, addresses
    return proc, workers


def test_loopback_only_and_ctrl_c_leaves_no_process(job: Path) -> None:
    proc, workers = _sleeping_job_on_loopback(job)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    for pid in workers:
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"worker {pid} still running after Ctrl-C")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_die_with_a_killed_launcher_and_stay_on_loopback(job: Path) -> None:
    """As the OOM killer would: SIGKILL the launcher; no worker outlives it by 10 s. With an
    explicit ``--rdzv-endpoint 127.0.0.1:PORT`` every socket stays on loopback too."""
    with socket.socket() as s:  # a port for the explicit endpoint (the launcher binds it at once)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, workers = _sleeping_job_on_loopback(job, "--rdzv-endpoint", f"127.0.0.1:{port}")
    proc.kill()
    proc.communicate(timeout=30)
    killed = time.monotonic()
    while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 10:
        time.sleep(0.05)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "workers outlived their launcher by 10 s"
    print(f"workers gone {time.monotonic() - killed:.2f} s after the launcher's SIGKILL")
