"""One command for every node: ``--ssh`` with a hostfile starts each node's ``tessera`` over ssh.

``tessera run --hostfile hosts --ssh train.py`` (or ``train``) runs, for every host ``K`` of the
hostfile, ``ssh HOST 'cd <this folder> && env <TESSERA_* and the other forwarded variables>
<this python> -m tessera.launcher.run.cli <the same arguments, without --ssh> --node-rank K'``,
as DeepSpeed and Colossal-AI users start a job: every node then runs the same command as one
typed by hand there. The nodes need the same Python at the same path and this folder (a shared
file system, or the same checkout) and passwordless ssh. ``--ssh-command`` replaces ``ssh``
(e.g. ``"ssh -p 2222 -o BatchMode=yes"``). Each node's output comes back line by line,
prefixed with ``[host]``; the exit code is the worst of the nodes' (a failed ssh is 255). An
interrupt stops every node's ssh, and with it the remote command.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO

__all__ = ["FORWARDED", "remote_command", "start_every_node"]

FORWARDED = ("PYTHONPATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")
"""Variables passed on to every node besides ``TESSERA_*`` (when set here)."""


def without_ssh(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--ssh`` and ``--ssh-command VALUE`` (either spelling)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ssh":
            continue
        elif arg == "--ssh-command":
            skip = True
        elif not arg.startswith("--ssh-command="):
            out.append(arg)
    return out


def remote_command(argv: Sequence[str], node_rank: int, env: Mapping[str, str], cwd: str) -> str:
    """The shell command node ``node_rank`` runs: these arguments (``run ...`` or ``train ...``)
    there, as its rank."""
    keep = {k: v for k, v in env.items() if k.startswith("TESSERA_") or k in FORWARDED}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(keep.items()))
    head, rest = list(argv[:1]), list(argv[1:])  # the subcommand, then its options and the script's
    cli = [sys.executable, "-m", "tessera.launcher.run.cli", *head, "--node-rank", str(node_rank), *rest]
    command = shlex.join(cli)
    return f"cd {shlex.quote(cwd)} && " + (f"env {exports} {command}" if exports else command)


def _relay(stream: IO[bytes], host: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"[{host}] {line.decode(errors='replace')}")
        sys.stdout.flush()


def start_every_node(
    hosts: Sequence[str], argv: Sequence[str], ssh_command: str, say: Callable[[str], None]
) -> int:
    """Start ``argv`` on every host over ``ssh_command``; wait for all; the worst exit code."""
    ssh = shlex.split(ssh_command)
    procs, relays = [], []
    cwd = os.getcwd()
    for rank, host in enumerate(hosts):
        line = remote_command(without_ssh(argv), rank, os.environ, cwd)
        say(f"node {rank}: {ssh_command} {host} ...")
        proc = subprocess.Popen([*ssh, host, line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        relay = threading.Thread(target=_relay, args=(proc.stdout, host), daemon=True)
        relay.start()
        procs.append(proc)
        relays.append(relay)
    try:
        codes = [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
        say("interrupted; every node's ssh was stopped")
        return 130
    for relay in relays:
        relay.join(timeout=5)
    for rank, (host, code) in enumerate(zip(hosts, codes, strict=True)):
        if code:
            say(f"node {rank} ({host}) exited {code}")
    return max(codes, default=0)
