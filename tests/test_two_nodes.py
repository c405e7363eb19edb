"""Tier 3: two nodes, each its own network stack (a Linux network namespace), joined by one
virtual link; the rendezvous endpoint is node 0's IP address, as a user gives it.

The test makes the namespaces itself (``ip netns``, a veth pair, addresses 10.231.<k>.1 and
.2 that exist only inside them) and removes them after; traffic goes only over that link.
It needs root and ``ip``; elsewhere it is skipped with the reason. Each node runs ``tessera
run --nnodes 2 --node-rank K --rdzv-endpoint 10.231.<k>.1:29500`` by hand, as on two
machines; the losses must equal a one-node run of the same job bit for bit (the same gloo
collectives over the same ranks: ``TESSERA_SHM=0`` keeps the one-node run off shared memory,
which the two namespaces of one machine could otherwise share).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

JOB = """
import json, sys
import torch, torch.distributed as dist
from tessera.launcher import boost, load_config
from tessera.models import GPT, GPTConfig, make_batch

config = load_config()
dist.init_process_group("gloo")
cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)
model = GPT(cfg, seed=0)
with boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config) as engine:
    losses = [engine.train_step(*make_batch(cfg, 8, seed=s)).loss for s in range(4)]
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(losses, f)
dist.destroy_process_group()
"""


def _tessera(*args: str) -> list[str]:
    return [sys.executable, "-m", "tessera.launcher.run.cli", "run", *args]


@pytest.mark.parametrize("how", ["flags", "hostfile"])
def test_two_nodes_by_ip_train_as_one(tmp_path: Path, two_namespaces: tuple[str, str, str], how: str) -> None:
    """``flags``: --nnodes, --node-rank, --nproc-per-node and --rdzv-endpoint by hand on each
    node; ``hostfile``: the same command on both nodes, ``--hostfile`` listing the two
    addresses with ``slots=1``: each node finds its rank by its own address."""
    node0, node1, address = two_namespaces
    job = tmp_path / "job.py"
    job.write_text(JOB)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{address} slots=1\n{address[:-1]}2 slots=1\n")
    env = {**os.environ, "TESSERA_SHM": "0", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank, ns in enumerate((node0, node1)):
        nodes = (
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--rdzv-endpoint",
                f"{address}:29500",
            ]
            if how == "flags"
            else ["--hostfile", str(hosts)]
        )
        cmd = _tessera(
            *nodes, "--set", "parallel.dp=2", "--set", f"train.run_dir={tmp_path / f'runs{rank}'}",
            str(job), str(tmp_path / f"node{rank}.json"),
        )  # fmt: skip
        log = open(tmp_path / f"node{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=log, stderr=log, env=env), log)
        )
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=240))
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = {r: (tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1)}
    assert codes == [0, 0], f"exit codes {codes}; node logs: {logs}"
    assert "gloo uses tsv" in logs[0] and "gloo uses tsv" in logs[1], logs
    one = tmp_path / "one.json"
    single = _tessera(
        "--nproc-per-node",
        "2",
        "--set",
        "parallel.dp=2",
        "--set",
        f"train.run_dir={tmp_path}/r",
        str(job),
        str(one),
    )
    done = subprocess.run(single, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "node0.json").read_text()) == json.loads(one.read_text())


def test_node_0_must_own_the_endpoint_address(tmp_path: Path) -> None:
    """Refused before anything starts, in one line (torch would wait for its timeout)."""
    job = tmp_path / "job.py"
    job.write_text("")
    cmd = _tessera("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                   "--rdzv-endpoint", "192.0.2.7:29500", "--set", "parallel.dp=2", str(job))  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert (
        "--rdzv-endpoint 192.0.2.7:29500 is not an address of this machine, but node rank 0 hosts"
        in done.stderr
    )


FAKE_SSH = """#!/bin/sh
# a stand-in for ssh: "ssh HOST COMMAND" runs COMMAND inside the namespace that owns HOST
host="$1"; shift
case "$host" in
  {a0}) ns={n0} ;;
  {a1}) ns={n1} ;;
  *) echo "no such host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""


def test_one_command_starts_every_node_over_ssh(tmp_path: Path, two_namespaces: tuple[str, str, str]) -> None:
    """``tessera run --hostfile hosts --ssh``, typed once (here outside both nodes), starts the
    command on each host with its node rank (``ssh`` replaced by a script that enters the
    host's namespace, ``--ssh-command``); the losses equal a one-node run's."""
    node0, node1, address = two_namespaces
    other = address[:-1] + "2"
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH.format(a0=address, a1=other, n0=node0, n1=node1))
    ssh.chmod(0o755)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{address} slots=1\n{other} slots=1\n")
    env = {**os.environ, "TESSERA_SHM": "0", "OMP_NUM_THREADS": "1"}
    dp2 = ["--set", "parallel.dp=2", "--set", f"train.run_dir={tmp_path}/runs"]
    cmd = _tessera(
        "--hostfile",
        str(hosts),
        "--ssh",
        "--ssh-command",
        str(ssh),
        *dp2,
        str(job),
        str(tmp_path / "both.json"),
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"[{address}] " in done.stdout and f"[{other}] " in done.stdout, done.stdout[-3000:]
    single = _tessera("--nproc-per-node", "2", *dp2, str(job), str(tmp_path / "one.json"))
    one = subprocess.run(single, env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.loads((tmp_path / "both.json").read_text()) == json.loads((tmp_path / "one.json").read_text())
