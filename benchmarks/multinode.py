"""``hatch run bench multinode``: what losing a node costs, on two "nodes" made here.

Two network namespaces joined by a veth pair (addresses 10.232.<k>.1/.2 that exist only
inside them, removed at the end; needs root and ``ip``, else one JSON line says why it was
skipped) each run the main job, ``tessera train --nnodes ... --node-rank K`` by hand, with a
small model (``MODEL`` below), one process per node:

1. ``shared`` / ``own-disks``: the same job with one run folder both nodes see, then with a
   folder per node (no shared storage: every checkpoint file is copied to the other node).
   Per run: its median step time and tokens/s from metrics.jsonl, the checkpoints, and for
   ``own-disks`` the MiB and seconds the copies between the nodes took per save (node 0's
   log).
2. ``lost-node``: ``--nnodes 1:2``, ``train.max_restarts=1``; at step ``--kill-at`` node 1's
   link goes down and its processes are killed. Measured from that moment on node 0:
   ``detect_s`` (until it names the lost node), ``restart_s`` (from then until the job has
   resumed from its checkpoint), ``steps_lost`` (trained again: the kill step minus the
   resumed one) and ``finished`` (node 0 ran the job to its end alone).
3. ``planner-1000-nodes``: ``tessera.planner.restart`` for a 13B-parameter GPT on 1,000
   nodes of 8 A100s (dp 1000 x pp 8), with this run's relaunch time and the watchdog and
   checkpoint interval given, for a disk of ``--disk-gbps`` per node.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import emit

MODEL = [
    "parallel.dp=2",
    "model.d_model=64",
    "model.n_layers=2",
    "model.seq_len=32",
    "model.vocab_size=96",
    "data.batch_size=8",
    "data.max_chars=100000",
    "parallel.microbatches=1",
    "zero.stage=1",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.sample_chars=10",
    "optim.warmup_steps=2",
    "train.name=job",
]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _two_nodes() -> Iterator[tuple[list[str], list[str], str]]:
    k = os.getpid() % 250 + 1
    names = [f"tessera-b0-{os.getpid()}", f"tessera-b1-{os.getpid()}"]
    veth = [f"tsb{os.getpid()}{c}"[-15:] for c in "ab"]
    try:
        _ip("netns", "add", names[0])
        _ip("netns", "add", names[1])
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in (0, 1):
            _ip("link", "set", veth[i], "netns", names[i])
            _ip("-n", names[i], "addr", "add", f"10.232.{k}.{i + 1}/24", "dev", veth[i])
            _ip("-n", names[i], "link", "set", "lo", "up")
            _ip("-n", names[i], "link", "set", veth[i], "up")
        yield names, veth, f"10.232.{k}.1"
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


ENV = {**os.environ, "TESSERA_SHM": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _node(
    ns: str, rank: int, address: str, nnodes: str, settings: list[str], log: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "tessera.launcher.run.cli",
        "train",
        "--nnodes",
        nnodes,
        "--node-rank",
        str(rank),
    ]
    cmd += ["--nproc-per-node", "1", "--rdzv-endpoint", f"{address}:29500"]
    for item in settings:
        cmd += ["--set", item]
    out = log.open("w")
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=ENV,
        start_new_session=True,
    )


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _metrics(run: Path) -> list[dict[str, float]]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _throughput(run: Path) -> tuple[float, float]:
    rows = _metrics(run)[2:]  # past the first steps' warm-up
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(rows)]
    return statistics.median(steps), statistics.median(r["tokens_per_s"] for r in rows)


def _pair(
    names: list[str], address: str, nnodes: str, settings: list[str], tmp: Path, tag: str, disks: bool
) -> list[subprocess.Popen[bytes]]:
    return [
        _node(
            ns,
            k,
            address,
            nnodes,
            [*settings, f"train.run_dir={tmp}/{tag}{k if disks else ''}"],
            tmp / f"{tag}{k}.log",
        )
        for k, ns in enumerate(names)
    ]


def _storage_runs(names: list[str], address: str, tmp: Path, steps: int, every: int) -> float:
    settings = [*MODEL, f"train.steps={steps}", f"train.checkpoint_every={every}"]
    wall = 0.0
    for tag, disks in (("shared", False), ("own-disks", True)):
        started = time.perf_counter()
        codes = [_wait(p, 240) for p in _pair(names, address, "2", settings, tmp, tag, disks)]
        wall = time.perf_counter() - started
        log = (tmp / f"{tag}0.log").read_text()
        if codes != [0, 0]:
            raise RuntimeError(f"{tag}: exit codes {codes}\n{log[-3000:]}")
        run = tmp / (f"{tag}0" if disks else tag) / "job"
        step_s, tps = _throughput(run)
        copies = [
            (float(m), float(s))
            for m, s in re.findall(
                r"copied ([\d.]+) MiB of step-\d+ between checkpoint folders in ([\d.]+) s", log
            )
        ]
        emit({
            "bench": "multinode",
            "system": "tessera",
            "config": f"{tag}: 2 nodes x 1 process, dp 2, {steps} steps, a checkpoint every {every}",
            "step_time_s": step_s,
            "tokens_per_s": tps,
            "wall_s": wall,
            "saves": steps // every,
            "copied_mib_per_save": statistics.mean(m for m, _ in copies) if copies else 0.0,
            "copy_s_per_save": statistics.mean(s for _, s in copies) if copies else 0.0,
            "final_loss": _metrics(run)[-1]["loss"],
        })  # fmt: skip
    return wall


def _lost_node(
    names: list[str], veth: list[str], address: str, tmp: Path, kill_at: int, watchdog: float
) -> float:
    steps = kill_at + 20
    settings = [*MODEL, f"train.steps={steps}", "train.checkpoint_every=4", "train.max_restarts=1"]
    settings += [f"train.watchdog_s={watchdog}", "train.keep_last=10"]
    procs = _pair(names, address, "1:2", settings, tmp, "lost", True)
    run, log_path = tmp / "lost0" / "job", tmp / "lost0.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and procs[0].poll() is None:
        if (run / "metrics.jsonl").exists() and len(_metrics(run)) >= kill_at:
            break
        time.sleep(0.05)
    at_kill = len(_metrics(run))
    _ip("-n", names[1], "link", "set", veth[1], "down")
    os.killpg(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    detect = restart = None
    while procs[0].poll() is None and time.monotonic() - killed < 600:
        text = log_path.read_text()
        now = time.monotonic() - killed
        if detect is None and "is lost" in text:
            detect = now
        if detect is not None and restart is None and re.search(r"resumed from \S+ at step \d+", text):
            restart = now - detect
        time.sleep(0.05)
    code = _wait(procs[0], 300)
    text = log_path.read_text()
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    step_s, tps = _throughput(run)
    emit({
        "bench": "multinode",
        "system": "tessera",
        "config": f"lost-node: --nnodes 1:2, node 1 lost at step {at_kill}, train.watchdog_s={watchdog:g}",
        "step_time_s": step_s,
        "tokens_per_s": tps,
        "detect_s": detect,
        "restart_s": restart,
        "steps_lost": None if resumed is None else at_kill - int(resumed.group(1)),
        "finished": code == 0 and len(_metrics(run)) == steps,
    })  # fmt: skip
    return restart if restart is not None else 0.0


def _planner(relaunch_s: float, watchdog: float, every: int, disk_gbps: float) -> None:
    from tessera.planner import PRESETS, Job, Layout, ModelShape, estimate
    from tessera.planner.restart import restart_cost

    job = Job(
        ModelShape(layers=40, hidden=5120, heads=40, vocab=51200, seq=2048, batch=8000),
        precision="bf16",
        optimizer="adamw",
    )
    cluster = PRESETS["a100-80g"].with_world(8000)
    one = estimate(Layout(dp=1000, pp=8, microbatches=8, zero=1), job, cluster)
    cost = restart_cost(
        one,
        cluster,
        watchdog_s=watchdog,
        checkpoint_every=every,
        relaunch_s=relaunch_s,
        disk_bandwidth=disk_gbps * 1e9,
    )
    emit({
        "bench": "multinode",
        "system": "tessera.planner",
        "config": f"planner-1000-nodes: 13B GPT, dp 1000 x pp 8 on 8000 A100s, watchdog {watchdog:g} s, "
                  f"a checkpoint every {every} steps, disk {disk_gbps:g} GB/s per node",
        "step_time_s": one.time.total,
        "tokens_per_s": job.model.batch * job.model.seq / one.time.total,
        "detect_s": cost.detect,
        "relaunch_s": cost.relaunch,
        "load_s": cost.load,
        "redo_s": cost.redo,
        "restart_total_s": cost.total,
    })  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="steps of the storage runs")
    p.add_argument("--every", type=int, default=4, help="their checkpoint interval")
    p.add_argument("--kill-at", type=int, default=8, help="the step at which node 1 is lost")
    p.add_argument("--watchdog", type=float, default=10.0, help="train.watchdog_s of the lost-node run")
    p.add_argument("--disk-gbps", type=float, default=2.0, help="the planner's disk bandwidth per node")
    p.add_argument("--planner-every", type=int, default=500, help="the planner's checkpoint interval")
    args = p.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print(
            json.dumps({"bench": "multinode", "skipped": "network namespaces need root and the ip command"})
        )
        return 0
    with (
        tempfile.TemporaryDirectory(prefix="tessera-bench-multinode-") as tmp,
        _two_nodes() as (names, veth, address),
    ):
        _storage_runs(names, address, Path(tmp), args.steps, args.every)
        restart = _lost_node(names, veth, address, Path(tmp), args.kill_at, args.watchdog)
    _planner(restart, args.watchdog, args.planner_every, args.disk_gbps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
