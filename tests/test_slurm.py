"""Tier 4: the main job under a real SLURM, on two nodes made by the test.

One cluster for the whole module (``tessera.launcher.testing_slurm.SlurmCluster``): ``munged``
with a key of its own, ``slurmctld`` in a namespace of its own (``head``, where the client
commands run, as on a login node) and one ``slurmd`` per node, each node a network namespace
with its own address and hostname (``node0``, ``node1``); everything is killed and removed
after. It needs root, ``ip`` and Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs
them); where the cluster cannot be made the module is skipped with the reason.

The batch script and the ``srun`` line are the ones in docs/multi-node.md, as written, with one
process per node (``--nproc-per-node 1``, this machine has two cores) and a small model in the
test's ``job.toml`` (a constant learning rate: a run's schedule does not depend on
``train.steps``, so a run given many steps takes the same first steps as a short one). Losses
are compared bit for bit with a one-node run of the same job (dp 2 in one place: the same gloo
collectives over the same ranks, ``TESSERA_SHM=0``), as tests/test_two_nodes.py does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tessera.launcher.testing_slurm import SlurmCluster, SlurmUnavailable

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[1] / "docs" / "multi-node.md"
JOB = """\
[parallel]
dp = "auto"
microbatches = 1
[zero]
stage = 1
[model]
seq_len = 16
d_model = 32
n_heads = 4
n_layers = 2
vocab_size = 96
[optim]
warmup_steps = 0
min_lr_ratio = 1.0
[data]
batch_size = 4
max_chars = 50000
[train]
steps = {steps}
log_every = 1
eval_every = 1000
checkpoint_every = {every}
keep_last = 10
sample_chars = 4
"""
REFERENCE_STEPS = 30
STOP = re.compile(
    r"tessera: stopped by (SIG\w+) after step (\d+): saved (\S+); resume with --set train\.resume=(\S+)"
)
WAIT_S = 240  # a bound on every wait, not a measurement
OVER = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def _doc_block(starts: str) -> str:
    """The fenced block of docs/multi-node.md's SLURM section that begins with ``starts``."""
    section = DOC.read_text().split("\n## SLURM\n", 1)[1].split("\n## ", 1)[0]
    blocks: list[str] = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if b.startswith(starts)]
    assert len(blocks) == 1, (
        f"docs/multi-node.md's SLURM section has {len(blocks)} blocks starting {starts!r}"
    )
    return blocks[0]


def _one_process(text: str) -> str:
    """``text`` with one process per node instead of eight (the only change made to the docs)."""
    assert text.count("--nproc-per-node 8") == 1, text
    return text.replace("--nproc-per-node 8", "--nproc-per-node 1")


def _env() -> dict[str, str]:
    """The job's environment (sbatch and srun pass it on): this Python's ``tessera`` first on
    PATH, no TESSERA_* setting of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    bin_dir = str(Path(sys.executable).parent)
    return {**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}", "TESSERA_SHM": "0", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


def _workdir(root: Path, name: str, steps: int, every: int) -> Path:
    """A submit folder with the docs' script and a ``job.toml`` of ``steps`` steps that saves a
    generation every ``every`` steps (0: only when it stops)."""
    work = root / name
    work.mkdir()
    (work / "train.sbatch").write_text(_one_process(_doc_block("#!/bin/bash")))
    (work / "job.toml").write_text(JOB.format(steps=steps, every=every))
    return work


def _losses(run: Path) -> list[tuple[int, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _train_here(work: Path, *sets: str) -> list[tuple[int, float]]:
    """``tessera train`` on this machine alone, two processes (dp 2), in ``work``; its losses."""
    cmd = [
        sys.executable,
        "-m",
        "tessera.launcher.run.cli",
        "train",
        "--config",
        "job.toml",
        "--nproc-per-node",
        "2",
    ]
    for s in [*sets, "train.name=one"]:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(work / "runs" / "one")


def _wait(until: Callable[[], bool], what: Callable[[], str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not until():
        assert time.monotonic() < deadline, what()
        time.sleep(0.2)


def _output(work: Path, job: int) -> str:
    path = work / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(text: str) -> str:
    """The end of a job's output without its progress bars, for a failure's message."""
    return "\n".join(line for line in text.splitlines() if not re.search(r" \d+/\d+ \[", line))[-4000:]


def _training(cluster: SlurmCluster, job: int, run: Path, steps: int, work: Path) -> None:
    """Until ``job`` has logged ``steps`` steps into ``run`` (it must still be running then)."""
    _wait(
        lambda: len(_losses(run)) >= steps or cluster.job(job)["JobState"] in OVER,
        lambda: _tail(_output(work, job)),
    )
    assert cluster.job(job)["JobState"] == "RUNNING", _tail(_output(work, job))


def _cancel_every_job(cluster: SlurmCluster) -> None:
    jobs = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
    if jobs:
        cluster.run("scancel", "--signal=KILL", "--full", *jobs, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with contextlib.ExitStack() as stack:
        try:
            made = stack.enter_context(SlurmCluster(tmp_path_factory.mktemp("slurm")))
        except SlurmUnavailable as exc:
            pytest.skip(f"no SLURM cluster here: {exc}")
        yield made


@pytest.fixture(autouse=True)
def _no_job_left(cluster: SlurmCluster) -> Iterator[None]:
    """A job a failed test leaves behind is cancelled before the next test submits its own."""
    yield
    _cancel_every_job(cluster)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    """The losses of the job's first REFERENCE_STEPS steps, trained on one node."""
    work = tmp_path_factory.mktemp("one-node")
    (work / "job.toml").write_text(JOB.format(steps=REFERENCE_STEPS, every=0))
    losses = _train_here(work)
    assert [s for s, _ in losses] == list(range(1, REFERENCE_STEPS + 1))
    return losses


def test_the_docs_batch_script_trains_on_both_nodes_as_one_node_does(
    cluster: SlurmCluster, one_node: list[tuple[int, float]], tmp_path: Path
) -> None:
    work = _workdir(tmp_path, "docs", steps=6, every=2)
    job = cluster.sbatch(work / "train.sbatch", env=_env(), cwd=work)
    fields = cluster.wait_for_job(job, lambda f: f["JobState"] in OVER, WAIT_S)
    out = _output(work, job)
    assert fields["JobState"] == "COMPLETED" and fields["NodeList"] == "node[0-1]", (fields, _tail(out))
    assert "tessera: node 0: gloo uses" in out and "tessera: node 1: gloo uses" in out, _tail(out)
    run = work / "runs" / f"run-{job}"
    for step in (2, 4, 6):
        manifest = json.loads((run / "checkpoint" / f"step-{step:08d}" / "manifest.json").read_text())
        assert manifest["step"] == step
    assert _losses(run) == one_node[:6]


def test_srun_then_scancel_term_saves_a_generation_and_every_node_exits_143(
    cluster: SlurmCluster, one_node: list[tuple[int, float]], tmp_path: Path
) -> None:
    work = _workdir(tmp_path, "direct", steps=100_000, every=0)
    line = _one_process(_doc_block("srun --nodes=2")).split()
    srun = cluster.popen(*line, log=work / "srun.log", env=_env(), cwd=work)
    run = work / "runs" / "run1"

    def log() -> str:
        return _tail((work / "srun.log").read_text(errors="replace"))

    try:
        _wait(lambda: bool(_losses(run)) or srun.poll() is not None, log)
        assert srun.poll() is None, log()
        (job,) = cluster.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split()
        cluster.run("scancel", "--signal=TERM", job)
        code = srun.wait(timeout=WAIT_S)
    finally:
        if srun.poll() is None:
            _cancel_every_job(cluster)
            srun.wait(timeout=60)
    out = (work / "srun.log").read_text(errors="replace")
    assert code == 143 and "Traceback" not in out, _tail(out)
    stops = STOP.findall(out)
    assert len(stops) == 2 and stops[0] == stops[1], _tail(out)  # both nodes' tessera, one step
    name, step, generation, resume = stops[0]
    assert name == "SIGTERM" and resume == "runs/run1/checkpoint", stops
    assert json.loads((work / generation / "manifest.json").read_text())["step"] == int(step)
    assert int(step) <= REFERENCE_STEPS, (
        f"stopped after step {step}, past the one-node run's {REFERENCE_STEPS}"
    )
    assert _losses(run) == one_node[: int(step)]


def test_the_time_limit_s_warning_saves_and_the_requeued_job_goes_on_exactly(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``--signal=USR1@120`` (the docs' script) on a job submitted with ``--time=10``; once it
    trains, its limit is lowered to 2 minutes, so the warning is due at SLURM's next check (it
    checks every 30 s). Every node's ``tessera`` saves and exits 138; the script requeues the
    job; the test restores the limit and starts it 2 s later (instead of SLURM's 120 s wait), with
    ``job.toml`` now ending 3 steps after the stop. It resumes from the stop's generation in
    the same run folder, and its losses after the resume equal a fresh one-node resume's."""
    work = _workdir(tmp_path, "limit", steps=100_000, every=0)
    job = cluster.sbatch(work / "train.sbatch", "--time=10", env=_env(), cwd=work)
    run = work / "runs" / f"run-{job}"
    _training(cluster, job, run, 1, work)
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=2")
    fields = cluster.wait_for_job(
        job, lambda f: (f["JobState"] == "PENDING" and f["Restarts"] != "0") or f["JobState"] in OVER, WAIT_S
    )
    out = _output(work, job)
    assert fields["JobState"] == "PENDING" and fields["Restarts"] == "1", (fields, _tail(out))
    stops = STOP.findall(out)
    assert len(stops) == 2 and stops[0] == stops[1] and "Traceback" not in out, _tail(out)
    name, step, generation, resume = stops[0]
    assert name == "SIGUSR1" and resume == f"runs/run-{job}/checkpoint", stops
    assert "Exited with exit code 138" in out, _tail(out)
    stopped = int(step)
    assert [s for s, _ in _losses(run)] == list(range(1, stopped + 1))
    # the same generation, resumed on one node, beside the job started again
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copytree(work / generation, fresh / "from" / Path(generation).name)
    (fresh / "job.toml").write_text(JOB.format(steps=stopped + 3, every=0))
    (work / "job.toml").write_text(JOB.format(steps=stopped + 3, every=0))
    # StartTime: 2 s on, so the new launch credential is younger than the old one's revocation
    # (a start in the same second is refused: "Job credential revoked")
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=10", "StartTime=now+2")
    want = _train_here(fresh, f"train.resume={fresh / 'from'}")
    fields = cluster.wait_for_job(job, lambda f: f["JobState"] in OVER, WAIT_S)
    out = _output(work, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, _tail(out))
    assert f"tessera: SLURM restart 1 of job {job}: resuming from runs/run-{job}/checkpoint" in out, out[
        -4000:
    ]
    assert f"resumed from {generation} at step {stopped}" in out, _tail(out)
    losses = _losses(run)
    assert [s for s, _ in losses] == list(range(1, stopped + 4))  # one run folder, every step once
    assert losses[stopped:] == [(s, v) for s, v in want if s > stopped]


def test_a_failed_node_is_named_and_the_job_finishes_on_the_node_left(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The docs' ``sbatch --no-kill train.sbatch --nnodes 1:2 --set train.max_restarts=1`` (and
    ``train.watchdog_s=10``): node 1 fails mid-run (its link goes down, then its slurmd, step
    daemon and ranks are killed)."""
    work = _workdir(tmp_path, "lost", steps=12, every=2)
    line = _doc_block("sbatch --no-kill").split()
    cut = line.index("train.sbatch")  # sbatch's options, then the script's arguments
    args = [*line[1:cut], "--", *line[cut + 1 :], "--set", "train.watchdog_s=10"]
    job = cluster.sbatch(work / "train.sbatch", *args, env=_env(), cwd=work)
    run = work / "runs" / f"run-{job}"
    _training(cluster, job, run, 4, work)
    node1 = cluster.nodes[1]
    try:
        cluster.fail_node(node1)
        fields = cluster.wait_for_job(job, lambda f: f["JobState"] in OVER, WAIT_S)
    finally:
        _cancel_every_job(cluster)  # a job still running holds node 0: it would never be idle
        cluster.restore_node(node1)
    out = _output(work, job)
    assert fields["JobState"] == "COMPLETED", (fields, _tail(out))
    assert re.search(r"tessera: node 1 \(node1, ranks 1\) is lost: no heartbeat for \d+ s", out), _tail(out)
    assert "tessera: restart 1 of 1 on the nodes that remain (at least 1)" in out, _tail(out)
    resumed = re.search(rf"resumed from runs/run-{job}/checkpoint/step-\d+ at step (\d+) \(restart 1\)", out)
    assert resumed is not None, _tail(out)
    assert [s for s, _ in _losses(run)] == list(range(1, 13))
    assert json.loads((run / "checkpoint" / "step-00000012" / "manifest.json").read_text())["step"] == 12
