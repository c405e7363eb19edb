"""A real SLURM cluster on this machine, for tests: ``slurmctld`` and one ``slurmd`` per node,
every node a Linux network namespace with its own address and its own hostname.

`SlurmCluster` (a context manager; root, and Debian's ``slurm-wlm`` and ``munge`` packages)
makes a namespace for the controller (hostname ``head``, holding a bridge) and one per node
(``node0``, ``node1``, ..., each joined to the bridge by a veth pair), with addresses
10.239.<k>.x that exist only inside them; a munge key of its own and ``munged`` on a socket of
its own; a ``slurm.conf``; then starts slurmctld and every slurmd and waits until each node is
idle. `SlurmCluster.run` and `SlurmCluster.popen` run client commands (``sbatch``, ``srun``,
``scancel``, ``scontrol``) in the controller's namespace, as a user on a login node does.
Everything lives in one folder; on exit every process in the namespaces is killed and the
namespaces, and their ``/etc/netns/<namespace>/`` files, are removed. Where a cluster cannot be
made (not root, no ``ip``, the packages missing, a daemon that does not start), `SlurmUnavailable`
says why.

What SLURM needs to run in network namespaces, all written here:

- ``ip netns exec`` mounts a sysfs of the namespace over ``/sys``, which hides
  ``/sys/fs/cgroup``: slurmd's cgroup autodetection fails there, so ``cgroup.conf`` names the
  plugin (``CgroupPlugin=cgroup/v1``) and nothing else uses cgroups
  (``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``).
- Each daemon finds its node by its hostname: each runs in a UTS namespace of its own
  (``unshare --uts``) named as in ``slurm.conf``, whose ``NodeAddr`` gives each address.
- Node names resolve inside the namespaces through ``/etc/netns/<namespace>/hosts``, which
  ``ip netns exec`` binds over ``/etc/hosts`` (``tessera`` resolves node 0's name).
- One file system for every node: ``SlurmdSpoolDir``, ``SlurmdPidFile`` and ``SlurmdLogFile``
  take the node's name (``%n``).
- ``SlurmdParameters=config_overrides``: the nodes declare more CPUs than the machine has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["SlurmCluster", "SlurmNode", "SlurmUnavailable"]

log = logging.getLogger(__name__)

PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scancel", "scontrol", "sinfo", "squeue")
INSTALL = "apt-get install -y --no-install-recommends slurm-wlm munge"


class SlurmUnavailable(RuntimeError):
    """A SLURM cluster cannot be made on this machine (the message says why)."""


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """One node: its SLURM name (also its hostname), network namespace and address."""

    name: str
    namespace: str
    address: str
    veth: str  # its end of the link to the bridge, inside its namespace


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"({path} was not written)"


SLURM_CONF = """\
ClusterName=tessera
SlurmctldHost=head({head})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
KillWait=30
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """``slurmctld`` and ``nodes`` slurmds, each in a network namespace (module docstring), in
    folder ``root``. ``cpus``: what each node declares; ``slurmd_timeout``: seconds after which
    the controller marks a silent node down."""

    def __init__(self, root: Path, *, nodes: int = 2, cpus: int = 32, slurmd_timeout: int = 10) -> None:
        self.root = root
        self.cpus = cpus
        self.slurmd_timeout = slurmd_timeout
        pid = os.getpid()
        k = pid % 250 + 1
        self.head_namespace = f"tslurm-head-{pid}"
        self.head_address = f"10.239.{k}.254"
        self.nodes = [
            SlurmNode(f"node{i}", f"tslurm-n{i}-{pid}", f"10.239.{k}.{i + 1}", f"tsl{pid}{i}"[-15:])
            for i in range(nodes)
        ]
        self.conf = root / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._made: list[str] = []  # namespaces made, in order

    # -- the cluster ---------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        if os.geteuid() != 0:
            raise SlurmUnavailable("a SLURM cluster in network namespaces needs root")
        missing = [name for name in ("ip", "unshare", *PROGRAMS) if shutil.which(name) is None]
        if missing:
            raise SlurmUnavailable(f"{', '.join(missing)} not found: {INSTALL}")
        try:
            self._make_namespaces()
            self._write_files()
            self._start_daemons()
        except BaseException:
            self.close()
            raise
        log.info(
            "SLURM cluster up in %s: slurmctld on head (%s), %s",
            self.root,
            self.head_address,
            ", ".join(f"slurmd on {n.name} ({n.address})" for n in self.nodes),
        )
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _make_namespaces(self) -> None:
        head = self.head_namespace
        try:
            _ip("netns", "add", head)
        except (subprocess.CalledProcessError, OSError) as exc:
            raise SlurmUnavailable(f"cannot create a network namespace here: {exc}") from None
        self._made.append(head)
        _ip("-n", head, "link", "add", "br0", "type", "bridge")
        _ip("-n", head, "addr", "add", f"{self.head_address}/24", "dev", "br0")
        _ip("-n", head, "link", "set", "br0", "up")
        _ip("-n", head, "link", "set", "lo", "up")
        for i, node in enumerate(self.nodes):
            _ip("netns", "add", node.namespace)
            self._made.append(node.namespace)
            outer = f"tsb{os.getpid()}{i}"[-15:]
            _ip("link", "add", node.veth, "type", "veth", "peer", "name", outer)
            _ip("link", "set", node.veth, "netns", node.namespace)
            _ip("link", "set", outer, "netns", head)
            _ip("-n", head, "link", "set", outer, "master", "br0")
            _ip("-n", head, "link", "set", outer, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.veth)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("-n", node.namespace, "link", "set", node.veth, "up")
        hosts = "".join(
            f"{a} {n}\n" for a, n in [("127.0.0.1", "localhost"), (self.head_address, "head")]
        ) + "".join(f"{node.address} {node.name}\n" for node in self.nodes)
        for namespace in self._made:  # `ip netns exec` binds this over /etc/hosts
            folder = Path("/etc/netns") / namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts)

    def _write_files(self) -> None:
        root = self.root
        for sub in ("state", "log", "munge", *(f"spool/{n.name}" for n in self.nodes)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={self.cpus} State=UNKNOWN" for n in self.nodes
        )
        self.conf.write_text(
            SLURM_CONF.format(
                head=self.head_address,
                root=root,
                slurmd_timeout=self.slurmd_timeout,
                nodes=nodes,
                names=",".join(n.name for n in self.nodes),
            )
        )
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # /sys/fs/cgroup is hidden

    def _daemon(self, key: str, namespace: str | None, hostname: str | None, cmd: Sequence[str]) -> None:
        out = (self.root / "log" / f"{key}.out").open("wb")
        argv = list(cmd)
        if hostname is not None:
            argv = ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *argv]
        if namespace is not None:
            argv = ["ip", "netns", "exec", namespace, *argv]
        self._daemons[key] = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        out.close()

    def _start_daemons(self) -> None:
        m = self.root / "munge"
        self._daemon(
            "munged",
            None,
            None,
            ["munged", "--foreground", "--force", f"--socket={m / 'socket'}", f"--key-file={m / 'munge.key'}",
             f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'seed'}"],
        )  # fmt: skip
        self._wait(lambda: (m / "socket").exists(), 20, lambda: "munged made no socket", m / "munged.log")
        self._daemon(
            "slurmctld", self.head_namespace, "head", ["slurmctld", "-D", "-i", "-f", str(self.conf)]
        )
        for node in self.nodes:
            self.start_slurmd(node)
        self.wait_until_idle(60)

    def start_slurmd(self, node: SlurmNode) -> None:
        """Start ``node``'s slurmd (again, after `fail_node`)."""
        self._daemon(node.name, node.namespace, node.name, ["slurmd", "-D", "-f", str(self.conf)])

    def _wait(
        self, ready: Callable[[], bool], timeout: float, what: Callable[[], str], logfile: Path
    ) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for key, proc in self._daemons.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(
                        f"{key} exited with {proc.returncode}: {_tail(self.root / 'log' / f'{key}.out')}"
                        f"\n{_tail(logfile)}"
                    )
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what()} within {timeout:.0f} s: {_tail(logfile)}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` gives it (``idle``, ``alloc``, ``down*``...)."""
        done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def wait_until_idle(self, timeout: float) -> None:
        """Until every node is idle (SlurmUnavailable naming the states and the logs if not)."""
        names = {n.name for n in self.nodes}

        def idle() -> bool:
            states = self.node_states()
            return set(states) == names and all(s == "idle" for s in states.values())

        states = lambda: f"the nodes were not idle ({self.node_states()})"  # noqa: E731
        self._wait(idle, timeout, states, self.root / "log" / "slurmctld.log")

    def close(self) -> None:
        """Stop every daemon, kill every process left in the namespaces, remove the namespaces."""
        for proc in self._daemons.values():
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._daemons.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._daemons.clear()
        for namespace in reversed(self._made):
            self.kill_namespace(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        self._made.clear()

    # -- using it ----------------------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, with ``SLURM_CONF`` naming the cluster's configuration."""
        return {**os.environ, **(extra or {}), "SLURM_CONF": str(self.conf)}

    def command(self, *cmd: str) -> list[str]:
        """``cmd`` run in the controller's namespace."""
        return ["ip", "netns", "exec", self.head_namespace, *cmd]

    def run(
        self, *cmd: str, check: bool = True, env: Mapping[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run the client command ``cmd`` in the controller's namespace; its output as text."""
        done = subprocess.run(
            self.command(*cmd), capture_output=True, text=True, env=self.env(env), cwd=cwd, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def popen(
        self, *cmd: str, log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in the controller's namespace, its output into ``log``."""
        with log.open("wb") as out:
            return subprocess.Popen(
                self.command(*cmd), stdout=out, stderr=subprocess.STDOUT, env=self.env(env), cwd=cwd,
                start_new_session=True,
            )  # fmt: skip

    def sbatch(
        self, script: Path, *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        """Submit ``script`` (``args``: sbatch's options, then the script's arguments); its job id."""
        done = self.run("sbatch", "--parsable", *_split(args, script), env=env, cwd=cwd)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job`` (``JobState``, ``Restarts``, ``ExitCode``...)."""
        done = self.run("scontrol", "show", "job", "-o", str(job))
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_for_job(
        self, job: int, ready: Callable[[dict[str, str]], bool], timeout: float
    ) -> dict[str, str]:
        """Poll ``job`` until ``ready(its fields)``; its fields (TimeoutError with them if not)."""
        deadline = time.monotonic() + timeout
        fields = self.job(job)
        while not ready(fields):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} after {timeout:.0f} s: {fields}")
            time.sleep(0.2)
            fields = self.job(job)
        return fields

    def kill_namespace(self, namespace: str) -> None:
        """SIGKILL every process in ``namespace`` (a vanished machine: nothing says goodbye)."""
        for _ in range(3):  # a process may fork while its siblings die
            pids = subprocess.run(
                ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30
            )
            found = [int(p) for p in pids.stdout.split()]
            if not found:
                return
            for pid in found:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def fail_node(self, node: SlurmNode) -> None:
        """``node`` fails: its link goes down (nothing it sends arrives any more), then its slurmd,
        every step daemon and every rank on it are killed."""
        log.info("failing %s: its link goes down, every process on it is killed", node.name)
        _ip("-n", node.namespace, "link", "set", node.veth, "down")
        self.kill_namespace(node.namespace)
        proc = self._daemons.pop(node.name, None)
        if proc is not None:
            proc.wait(timeout=10)

    def restore_node(self, node: SlurmNode, timeout: float = 60) -> None:
        """Bring a failed ``node`` back: link up, slurmd started, until every node is idle."""
        _ip("-n", node.namespace, "link", "set", node.veth, "up")
        self.start_slurmd(node)
        self.wait_until_idle(timeout)


def _split(args: Sequence[str], script: Path) -> list[str]:
    """sbatch's argument list: the options before ``--``, the script, then its own arguments."""
    items = list(args)
    if "--" in items:
        cut = items.index("--")
        return [*items[:cut], str(script), *items[cut + 1 :]]
    return [*items, str(script)]
