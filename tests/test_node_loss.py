"""Tier 3: the main job on two nodes that share no storage, and losing one of them.

Each node is a network namespace (``two_namespaces`` in conftest.py: a veth pair, addresses
only inside the namespaces, removed after) and has its own run folder, as two machines with
their own disks: ``tessera train --nnodes ... --node-rank K --rdzv-endpoint <node 0's IP>``
by hand on each.

- Without shared storage the job checkpoints (every file kept in both nodes' folders) and
  its losses equal a one-node run of the same job bit for bit (``TESSERA_SHM=0``: the same
  gloo collectives over the same ranks).
- With ``--nnodes 1:2`` and ``train.max_restarts=1``, node 1 is lost mid-run (its link goes
  down, then its processes are killed: no goodbye reaches node 0). Node 0 names the lost node
  and its ranks, ends its own workers instead of waiting in a collective, restarts alone
  (dp 2 -> 1, resharded from its folder's newest generation) and finishes. Its losses after
  the resume equal a fresh one-process resume from the same generation, bit for bit.
- The same with node 0 lost, the rendezvous host: node 1 hosts the rendezvous from then on and
  finishes alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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
    "model.vocab_size=96",
    "data.batch_size=4",
    "data.max_chars=50000",
    "train.log_every=1",
    "train.eval_every=100",
    "train.checkpoint_every=2",
    "train.keep_last=10",
    "train.sample_chars=10",
    "optim.warmup_steps=2",
    "train.name=job",
]
ENV = {**os.environ, "TESSERA_SHM": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _train(*args: str, settings: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train", *args]
    for item in settings:
        cmd += ["--set", item]
    return cmd


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _start(ns: str, cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("w")
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=ENV,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_for_step(proc: subprocess.Popen[bytes], run: Path, step: int, log: Path) -> None:
    """Until node 0's run has logged ``step`` (it must still be running then)."""
    deadline = time.monotonic() + 240  # a bound on the wait, not a measurement
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and max(_losses(run), default=0) >= step:
            break
        time.sleep(0.1)
    assert proc.poll() is None, log.read_text()[-3000:]


def _resumes_as_fresh(run: Path, log: str, settings: list[str], dp: int, tmp_path: Path) -> None:
    """The losses after the restart (of a 10-step job) equal those of a fresh ``dp``-process
    resume from the generation the restart resumed from, as node 0's ``log`` names it."""
    resumed = re.search(r"resumed from (\S+) at step (\d+)", log)
    assert resumed is not None, log[-4000:]
    step = int(resumed.group(2))
    gen = run / "checkpoint" / f"step-{step:08d}"
    fresh = tmp_path / "fresh-from"
    shutil.copytree(gen, fresh / gen.name)
    alone = [*settings, f"parallel.dp={dp}", f"train.run_dir={tmp_path}/fresh", f"train.resume={fresh}"]
    cmd = _train("--nproc-per-node", str(dp), settings=alone)
    again = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    after = {s: v for s, v in _losses(run).items() if s > step}
    want = {s: v for s, v in _losses(tmp_path / "fresh" / "job").items() if s > step}
    assert sorted(after) == list(range(step + 1, 11)) and after == want, (after, want)


def _node(
    ns: str, rank: int, address: str, nnodes: str, settings: list[str], tmp: Path
) -> subprocess.Popen[bytes]:
    """``tessera train`` on node ``rank`` (one process), by hand, with its own disk's run folder."""
    flags = ["--nnodes", nnodes, "--node-rank", str(rank), "--nproc-per-node", "1"]
    flags += ["--rdzv-endpoint", f"{address}:29500"]
    own = [*settings, f"train.run_dir={tmp}/disk{rank}"]
    return _start(ns, _train(*flags, settings=own), tmp / f"node{rank}.log")


def test_two_nodes_without_shared_storage_train_as_one(
    tmp_path: Path, two_namespaces: tuple[str, str, str]
) -> None:
    node0, node1, address = two_namespaces
    settings = [*SETTINGS, "train.steps=6"]
    procs = [_node(ns, k, address, "2", settings, tmp_path) for k, ns in enumerate((node0, node1))]
    codes = [_finish(p, 300) for p in procs]
    logs = [(tmp_path / f"node{k}.log").read_text() for k in (0, 1)]
    assert codes == [0, 0], f"exit codes {codes}; logs: {[t[-3000:] for t in logs]}"
    assert "is not shared: 2 folders" in logs[0], logs[0][-3000:]
    folders = [tmp_path / f"disk{k}" / "job" / "checkpoint" / "step-00000006" for k in (0, 1)]
    manifests = [json.loads((f / "manifest.json").read_text()) for f in folders]
    assert manifests[0] == manifests[1] and "storage" in manifests[0]
    for folder in folders:  # each node's own disk holds the whole generation
        assert all((folder / rel).is_file() for rel in manifests[0]["files"]), folder
    together = _train("--nproc-per-node", "2", settings=[*settings, f"train.run_dir={tmp_path}/one"])
    one = subprocess.run(together, env=ENV, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert _losses(tmp_path / "disk0" / "job") == _losses(tmp_path / "one" / "job")


def test_a_lost_node_is_named_and_the_job_finishes_on_the_node_left(
    tmp_path: Path, two_namespaces: tuple[str, str, str], unplug: Callable[..., None]
) -> None:
    node0, node1, address = two_namespaces
    settings = [*SETTINGS, "train.steps=10", "train.max_restarts=1", "train.watchdog_s=10"]
    procs = [_node(ns, k, address, "1:2", settings, tmp_path) for k, ns in enumerate((node0, node1))]
    run = tmp_path / "disk0" / "job"
    _wait_for_step(procs[0], run, 5, tmp_path / "node0.log")
    unplug(node1)  # node 1 vanishes: nothing it sends reaches node 0 any more
    os.killpg(procs[1].pid, signal.SIGKILL)
    lost_at = time.monotonic()
    code = _finish(procs[0], 300)
    waited = time.monotonic() - lost_at
    log = (tmp_path / "node0.log").read_text()
    assert code == 0, f"node 0 exited {code} ({waited:.0f} s after the loss):\n{log[-4000:]}"
    assert re.search(r"node 1 \(\S+, ranks 1\) is lost: no heartbeat for \d+ s", log), log[-4000:]
    assert "restart 1 of 1 on the nodes that remain (at least 1)" in log, log[-4000:]
    _resumes_as_fresh(run, log, settings, 1, tmp_path)


def test_losing_node_0_the_rendezvous_host_the_job_finishes_on_node_1(
    tmp_path: Path, two_namespaces: tuple[str, str, str], unplug: Callable[..., None]
) -> None:
    """Node 0 hosts the rendezvous and the node watch's store; it is lost mid-run. Node 1 names
    it, hosts the rendezvous itself at its own address, restarts alone from its own folder's
    newest generation and finishes, equal to a fresh one-process resume from it."""
    node0, node1, address = two_namespaces
    settings = [*SETTINGS, "train.steps=10", "train.max_restarts=1", "train.watchdog_s=10"]
    procs = [_node(ns, k, address, "1:2", settings, tmp_path) for k, ns in enumerate((node0, node1))]
    run = tmp_path / "disk1" / "job"  # rank 0 writes the metrics: node 0's folder until the loss
    _wait_for_step(procs[0], tmp_path / "disk0" / "job", 5, tmp_path / "node0.log")
    unplug(node0)  # node 0 vanishes, and with it both stores
    os.killpg(procs[0].pid, signal.SIGKILL)
    code = _finish(procs[1], 300)
    log = (tmp_path / "node1.log").read_text()
    assert code == 0, f"node 1 exited {code}:\n{log[-4000:]}"
    assert re.search(r"node 0 \(\S+\) is lost", log), log[-4000:]
    assert re.search(r"node 1 \(\S+\) hosts the rendezvous from now on", log), log[-4000:]
    assert "restart 1 of 1 on the nodes that remain (at least 1)" in log, log[-4000:]
    _resumes_as_fresh(run, log, settings, 1, tmp_path)


def test_a_partition_longer_than_the_watchdog_on_shared_storage_ends_in_one_job(
    tmp_path: Path, two_namespaces: tuple[str, str, str], unplug: Callable[..., None]
) -> None:
    """Both nodes write one run folder (shared storage); node 1's link goes down for 20 s, twice
    ``train.watchdog_s``: each side names the other lost. Node 0, the host, restarts alone; node
    1 sees node 0's lease in the run folder move and ends instead of taking over, so the two
    never train apart into the folder: the job finishes once, each step logged once."""
    node0, node1, address = two_namespaces
    settings = [*SETTINGS, "train.steps=14", "train.max_restarts=1", "train.watchdog_s=10"]
    shared = [*settings, f"train.run_dir={tmp_path}/shared"]
    flags = [["--nnodes", "1:2", "--node-rank", str(k), "--nproc-per-node", "1"] for k in (0, 1)]
    cmds = [_train(*f, "--rdzv-endpoint", f"{address}:29500", settings=shared) for f in flags]
    procs = [
        _start(ns, cmd, tmp_path / f"node{k}.log")
        for k, (ns, cmd) in enumerate(zip((node0, node1), cmds, strict=True))
    ]
    run = tmp_path / "shared" / "job"
    _wait_for_step(procs[0], run, 4, tmp_path / "node0.log")
    unplug(node1)
    time.sleep(20)
    unplug(node1, up=True)
    codes = [_finish(p, 300) for p in procs]
    logs = [(tmp_path / f"node{k}.log").read_text() for k in (0, 1)]
    assert codes[0] == 0 and codes[1] != 0, f"exit codes {codes}; logs: {[t[-3000:] for t in logs]}"
    assert re.search(r"node 1 \(\S+, ranks 1\) is lost", logs[0]), logs[0][-3000:]
    assert "node 0 is out of reach but still holds the run folder" in logs[1], logs[1][-3000:]
    assert "hosts the rendezvous from now on" not in logs[1], logs[1][-3000:]
    steps = [
        r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert steps == list(range(1, 15)), steps


def test_a_partition_shorter_than_the_watchdog_loses_nothing(
    tmp_path: Path, two_namespaces: tuple[str, str, str], unplug: Callable[..., None]
) -> None:
    """Node 1's link goes down for 3 s, well under ``train.watchdog_s`` (20 s), then up again:
    TCP carries on, nobody is named, and the losses equal an undisturbed run's."""
    node0, node1, address = two_namespaces
    settings = [*SETTINGS, "train.steps=12", "train.watchdog_s=20"]
    procs = [_node(ns, k, address, "2", settings, tmp_path) for k, ns in enumerate((node0, node1))]
    run = tmp_path / "disk0" / "job"
    _wait_for_step(procs[0], run, 3, tmp_path / "node0.log")
    unplug(node1)
    time.sleep(3)
    stalled_at = max(_losses(run))
    unplug(node1, up=True)
    assert procs[0].poll() is None and stalled_at < 12, "the job was over before the partition ended"
    codes = [_finish(p, 300) for p in procs]
    logs = [(tmp_path / f"node{k}.log").read_text() for k in (0, 1)]
    assert codes == [0, 0], f"exit codes {codes}; logs: {[t[-3000:] for t in logs]}"
    assert not any("is lost" in t for t in logs), logs
    together = _train("--nproc-per-node", "2", settings=[*settings, f"train.run_dir={tmp_path}/one"])
    one = subprocess.run(together, env=ENV, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert _losses(run) == _losses(tmp_path / "one" / "job")


def test_three_nodes_without_shared_storage_lose_one_and_go_on_with_two(
    tmp_path: Path, three_namespaces: tuple[list[str], list[str]], unplug: Callable[..., None]
) -> None:
    """Three nodes (one bridge), each its own disk, ``--nnodes 2:3``: every checkpoint file is
    kept on two of the three folders; node 2 is lost mid-run; nodes 0 and 1 name it, restart at
    dp 2 from their folders (node 2's files come from node 0, which held the copy) and finish,
    their losses after the resume equal to a fresh two-process resume from that generation."""
    names, addresses = three_namespaces
    settings = [*SETTINGS, "parallel.dp=3", "data.batch_size=6", "train.steps=10", "train.max_restarts=1"]
    settings += ["train.watchdog_s=10"]
    procs = [_node(ns, k, addresses[0], "2:3", settings, tmp_path) for k, ns in enumerate(names)]
    run = tmp_path / "disk0" / "job"
    _wait_for_step(procs[0], run, 5, tmp_path / "node0.log")
    unplug(names[2])
    os.killpg(procs[2].pid, signal.SIGKILL)
    codes = [_finish(p, 300) for p in procs[:2]]
    logs = [(tmp_path / f"node{k}.log").read_text() for k in (0, 1)]
    assert codes == [0, 0], f"exit codes {codes}; logs: {[t[-3000:] for t in logs]}"
    assert re.search(r"node 2 \(\S+, ranks 2\) is lost", logs[0]), logs[0][-3000:]
    assert "restart 1 of 1 on the nodes that remain (at least 2)" in logs[1], logs[1][-3000:]
    _resumes_as_fresh(run, logs[0], settings, 2, tmp_path)
