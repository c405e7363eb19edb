"""Where a job runs: one node, several nodes from flags or a hostfile, SLURM or OpenMPI.

Pure functions over the command-line values and the environment; nothing is contacted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NodePlan",
    "endpoint_host",
    "endpoint_of",
    "endpoint_port",
    "expand_slurm_nodelist",
    "is_loopback",
    "parse_nnodes",
    "plan_nodes",
    "read_hostfile",
    "slurm_restarts",
]

DEFAULT_PORT = 29500


@dataclass(frozen=True, slots=True)
class NodePlan:
    """The nodes of a job and this node's place among them."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    hosts: tuple[str, ...]
    rdzv_endpoint: str
    rdzv_id: str
    source: str  # "local", "flags", "hostfile", "slurm" or "openmpi"
    local_addr: str | None = None  # this node's address on the route to the endpoint (several nodes)
    min_nodes: int | None = None  # ``--nnodes MIN:MAX``: the job may go on with MIN of its nnodes
    host_node: int = 0  # the node hosting the rendezvous (a survivor's after the host is lost)

    @property
    def world_size(self) -> int:
        """Processes in the whole job (all of its nodes)."""
        return self.nnodes * self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """Whether the job may restart on fewer nodes than it started with."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def node_counts(self) -> range:
        """How many nodes the job may run on."""
        return range(self.min_nodes or self.nnodes, self.nnodes + 1)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` (torchrun's form) as (min, max); ValueError naming the text."""
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected N or MIN:MAX, two positive integers") from None
    if not sep and lo < 1:
        raise ValueError(f"--nnodes must be >= 1, got {lo}")
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes {text}: expected 1 <= MIN <= MAX, got MIN {lo} and MAX {hi}")
    return lo, hi


def is_loopback(endpoint: str) -> bool:
    """Whether the host of ``HOST:PORT`` is this machine's loopback interface."""
    host = endpoint.rpartition(":")[0]
    return host == "localhost" or host.startswith("127.")


def endpoint_host(endpoint: str) -> str:
    """The host of ``HOST:PORT`` (an IPv6 address without its brackets)."""
    return endpoint.rpartition(":")[0].strip("[]")


def endpoint_of(host: str, port: int) -> str:
    """``HOST:PORT`` (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def endpoint_port(endpoint: str) -> int:
    """The port of ``HOST:PORT`` (ValueError naming the endpoint when there is none)."""
    port = endpoint.rpartition(":")[2]
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port in [0, 65536)")
    return int(port)


def read_hostfile(path: str | Path) -> list[tuple[str, int | None]]:
    """Hosts of a DeepSpeed/MPI-style hostfile: ``host [slots=N]`` per line, ``#`` comments."""
    hosts: list[tuple[str, int | None]] = []
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not text"
        raise ValueError(f"--hostfile {str(path)!r} cannot be read: {reason}") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots: int | None = None
        for extra in parts[1:]:
            m = re.fullmatch(r"slots=(\d+)", extra)
            if m is None:
                raise ValueError(f"{path}:{number}: expected 'host [slots=N]', got {raw.strip()!r}")
            slots = int(m.group(1))
        hosts.append((parts[0], slots))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed node list, e.g. ``node[01-03,07],gpu5`` -> 4 + 1 names."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if m is None:
            names.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                names.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            names.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
    return names


def slurm_restarts(env: Mapping[str, str]) -> int:
    """How many times SLURM has started this batch job again (a requeue: ``scontrol requeue``,
    preemption, a failed node): ``SLURM_RESTART_COUNT``, which SLURM sets from the first restart
    on; 0 when it is not set or not a number."""
    text = env.get("SLURM_RESTART_COUNT", "")
    return int(text) if text.isdigit() else 0


def plan_nodes(
    *,
    nproc_per_node: int | None,
    nnodes: int | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    hostfile: str | None,
    env: Mapping[str, str],
    world_size: int | None = None,
    is_me: Callable[[str], bool] | None = None,
    min_nodes: int | None = None,
) -> NodePlan:
    """Decide the node layout: explicit flags win, then a hostfile, then SLURM, then OpenMPI,
    else one local node whose rendezvous binds to loopback. Under SLURM, ``--nnodes`` alone (such
    as ``MIN:MAX``) keeps SLURM's hosts and node rank; it must match SLURM's node count.

    Processes per node: ``nproc_per_node``, else the hostfile's ``slots=`` (the same on every
    host), else ``world_size`` (the configuration's) over the nodes. A hostfile's node rank,
    when not given, is the line of the first host ``is_me`` accepts (this machine's address).
    ``min_nodes`` (``--nnodes MIN:MAX``'s MIN): the job may restart on that many nodes."""
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nnodes is not None and nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if min_nodes is not None and not 1 <= min_nodes <= (nnodes or min_nodes):
        raise ValueError(f"--nnodes {min_nodes}:{nnodes}: MIN must be in [1, MAX]")
    job = env.get("SLURM_JOB_ID", "tessera")
    if hostfile is not None:
        listed = read_hostfile(hostfile)
        hosts = tuple(h for h, _ in listed)
        source = "hostfile"
        slots = {n for _, n in listed if n is not None}
        if len(slots) > 1:
            raise ValueError(f"hostfile {hostfile}: every host needs the same slots=, got {sorted(slots)}")
        if nproc_per_node is None and slots:
            nproc_per_node = slots.pop()
        if node_rank is None and is_me is not None:
            mine = [i for i, h in enumerate(hosts) if is_me(h)]
            if not mine:
                raise ValueError(
                    f"hostfile {hostfile}: this machine is none of {', '.join(hosts)}; pass --node-rank"
                )
            node_rank = mine[0]
    elif (nnodes is None or node_rank is None) and "SLURM_JOB_ID" in env and "SLURM_JOB_NODELIST" in env:
        hosts = tuple(expand_slurm_nodelist(env["SLURM_JOB_NODELIST"]))
        node_rank = int(env.get("SLURM_NODEID", "0")) if node_rank is None else node_rank
        source = "slurm"
    elif nnodes is None and "OMPI_COMM_WORLD_SIZE" in env:
        # one `tessera run` per node under mpirun: the MPI rank is the node rank
        count = int(env["OMPI_COMM_WORLD_SIZE"])
        node_rank = int(env.get("OMPI_COMM_WORLD_RANK", "0")) if node_rank is None else node_rank
        hosts = tuple(f"node{i}" for i in range(count))
        if rdzv_endpoint is None and count > 1:
            raise ValueError("under OpenMPI with several nodes, pass --rdzv-endpoint HOST:PORT of node 0")
        source = "openmpi"
    else:
        count = 1 if nnodes is None else nnodes
        hosts = tuple(f"node{i}" for i in range(count))
        source = "local" if count == 1 else "flags"
        if count > 1 and rdzv_endpoint is None:
            raise ValueError(f"--nnodes {count} needs --rdzv-endpoint HOST:PORT (the host of node 0)")
    if nnodes is not None and nnodes != len(hosts):
        raise ValueError(f"--nnodes {nnodes} but the {source} lists {len(hosts)} hosts")
    count = len(hosts)
    rank = 0 if node_rank is None else node_rank
    if not 0 <= rank < count:
        raise ValueError(f"node rank {rank} is outside [0, {count}) for {count} nodes")
    if nproc_per_node is None:  # the world size check that follows names a mismatch
        if world_size is None:
            raise ValueError("give --nproc-per-node (or a hostfile with slots=)")
        nproc_per_node = max(1, world_size // count)
    if rdzv_endpoint is None:
        rdzv_endpoint = "127.0.0.1:0" if count == 1 else f"{hosts[0]}:{DEFAULT_PORT}"
    endpoint_port(rdzv_endpoint)
    return NodePlan(count, rank, nproc_per_node, hosts, rdzv_endpoint, job, source, min_nodes=min_nodes)
