"""Hardware as data: a ``Cluster`` (nodes, devices, memory, FLOP/s, links) and its presets.

A cluster is ``nodes`` nodes of ``devices_per_node`` devices. Each device holds
``memory_gib`` and computes ``flops`` per second at the precision the job uses
(``flops_fp32`` for fp32 jobs: the planner asks `Cluster.device_flops`), of which a matmul-
heavy step reaches ``efficiency``. Links follow the alpha-beta model: a message of ``n``
bytes between two devices takes ``latency + n / bandwidth`` seconds, with one (latency,
bandwidth) pair inside a node (NVLink; shared memory on a CPU host) and one between
nodes (InfiniBand, per device: a DGX has one NIC per GPU). ``op_overhead_s`` is the fixed
cost of launching one operator (Python and kernel launch), which dominates tiny models.
The optimizer step streams its state through ``memory_bandwidth`` (device) or, offloaded,
``host_memory_bandwidth`` after copies over ``host_bandwidth``. ``overlap``: how much of the
compute time communication can hide under (1 on GPUs, whose copy engines and NICs work
beside the kernels; 0 on a CPU host, where gloo's threads compete for the same cores).
``a2a_latency`` / ``a2a_bandwidth``: when ``a2a_bandwidth`` > 0, an all-to-all (Ulysses) of a
tensor of ``n`` bytes per rank among ``k`` ranks takes ``(k-1) a2a_latency + (k-1)/k n /
a2a_bandwidth`` instead of the link's ring form: on this
host gloo's ``all_to_all_single`` (with tessera's stack and concatenation around it) costs
about what an all-reduce of the same buffer costs, 2-3x the ring form; ``--calibrate`` times
it on two processes. 0 (the GPU presets): the link's ring form.
``p2p_latency`` / ``p2p_bandwidth``: when ``p2p_bandwidth`` > 0, one point-to-point message
(a pipeline hop, a ring-attention step) inside a node takes ``p2p_latency + n /
p2p_bandwidth`` instead of the link's terms: on a CPU host a message goes through a
shared-memory FIFO (`tessera.comm.shm_p2p`), whose latency is about twice an all-reduce's.
``split_overhead``: what a zero-bubble schedule's backward split into B and W costs beyond
one full backward, as a fraction of it (`tessera.pipeline.Costs.split`; ``--calibrate``
times a pipeline stage of the reference GPT both ways); 0 on the GPU presets, not measured
there.
``shm_slots_bytes``: when > 0, the collectives of every group of ranks on one node go through
a shared-memory segment with that many bytes of slots (`tessera.comm.shm_sizes.SLOTS_BYTES`), which
each rank maps (`MemoryEstimate.shared`), and a collective among them pays its latency once per
phase whatever the group's size (`Link.flat`), not once per ring step; 0 on GPUs.
``node_flops``: when not 0, the devices of a node share this many fp32 FLOP/s (a CPU host
whose processes share its cores). A rank alone on its core runs at its full rate; when ``x``
ranks share each core (``x = ranks * flops_fp32 / node_flops > 1``), each rank's work (compute,
its collectives' copies and waits, the optimizer step) stretches by ``x (1 + crowding (x -
1))``: ``x`` for the cores' share, and ``crowding`` for what each extra rank per core costs
beyond its share (context switches, a collective that waits for a descheduled peer, caches
shared; ``tessera plan --calibrate`` times as many ranks as cores against twice as many). On
this host a step's wall time is its busiest rank's CPU time times the ranks per core within
5-10% in every configuration measured, which is why the stretch applies to the whole step
rather than to each message.

Presets: ``a100-80g`` (DGX A100: 8 x A100 80GB, NVLink 3 at ~240 GB/s achievable per
direction, 8 x HDR 200 Gb/s InfiniBand), ``h100-80g`` (DGX H100: NVLink 4, 8 x NDR 400
Gb/s), ``h200-141g`` (H100's links, 141 GB), and ``cpu`` (this machine, as measured by
``tessera plan --calibrate``, which writes a TOML of the same fields; its device count is
this machine's ``os.cpu_count()``, one device per core, not a fixed number). Peak FLOP/s are
the vendors' dense figures (A100: 312 TFLOP/s bf16, 19.5 fp32; H100/H200 SXM: 989 bf16, 67
fp32).

`resolve_cluster` is what a configuration's ``parallel.cluster`` means: a preset, a TOML
file, or (empty) the calibrated file at `calibrated_path` when ``tessera plan --calibrate``
wrote one there, else the ``cpu`` preset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tessera.comm.shm_sizes import SLOTS_BYTES

__all__ = ["PRESETS", "Cluster", "calibrated_path", "cluster_to_toml", "load_cluster", "resolve_cluster"]

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices, their memory and speed, and the two links of the alpha-beta model."""

    name: str = "cluster"
    nodes: int = 1
    devices_per_node: int = 8
    memory_gib: float = 80.0
    flops: float = 312e12  # per device, bf16/fp16 dense
    flops_fp32: float = 19.5e12  # per device, fp32 (no tensor-core TF32 assumed)
    efficiency: float = 0.6  # fraction of the peak a transformer step's matmuls reach
    node_flops: float = 0.0  # > 0: the node's devices share this (CPU cores)
    intra_bandwidth: float = 240e9  # bytes/s per device, one direction, inside a node
    intra_latency: float = 5e-6
    inter_bandwidth: float = 25e9  # bytes/s per device between nodes
    inter_latency: float = 10e-6
    op_overhead_s: float = 0.0  # fixed cost per operator launched
    memory_bandwidth: float = 2.0e12  # device memory, bytes/s (the optimizer step streams it)
    host_bandwidth: float = 25e9  # device <-> host copies per device (PCIe), bytes/s
    host_memory_bandwidth: float = 12e9  # host memory per device (an offloaded optimizer step)
    overlap: float = 1.0  # fraction of compute time under which communication can hide
    crowding: float = 0.0  # what each extra rank per core costs beyond its share (node_flops)
    a2a_latency: float = 0.0  # a measured all-to-all per message (with a2a_bandwidth > 0)
    a2a_bandwidth: float = 0.0  # bytes/s of a measured all-to-all; 0: the link's ring form
    p2p_latency: float = 0.0  # a measured point-to-point message (with p2p_bandwidth > 0)
    p2p_bandwidth: float = 0.0  # bytes/s of a measured message; 0: the link's own terms
    shm_slots_bytes: float = 0.0  # > 0: each group's collectives use a shared-memory segment
    split_overhead: float = 0.0  # a backward split into B and W (zero-bubble) costs this fraction more

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            if f.name in ("nodes", "devices_per_node"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"cluster.{f.name} must be an integer >= 1, got {value!r}")
            elif not isinstance(value, int | float) or value < 0 or value != value:
                raise ValueError(f"cluster.{f.name} must be a number >= 0, got {value!r}")
        for name in (
            "memory_gib",
            "flops",
            "flops_fp32",
            "efficiency",
            "intra_bandwidth",
            "inter_bandwidth",
            "memory_bandwidth",
            "host_bandwidth",
            "host_memory_bandwidth",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster.{name} must be > 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Devices in the whole cluster."""
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        """Memory of one device in bytes."""
        return self.memory_gib * GIB

    def ranks_per_node(self, world: int) -> int:
        """Ranks sharing one node when ``world`` ranks run here: nodes fill up first, and a
        world larger than the cluster puts its extra ranks on the same nodes (processes that
        share a CPU host's cores)."""
        return max(min(world, self.devices_per_node), -(-world // self.nodes))

    def device_flops(self, precision: str) -> float:
        """FLOP/s one rank sustains at ``precision`` on a device of its own (`crowd` says what
        sharing a node's cores adds)."""
        peak = self.flops_fp32 if precision == "fp32" else self.flops
        return peak * self.efficiency

    def link(self, span: int, ranks_on_node: int = 1) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of a group whose ranks lie ``span`` consecutive ranks
        apart at most: inside one node when the span fits a node (or the ``ranks_on_node``
        sharing it), otherwise across nodes."""
        if self.inside(span, ranks_on_node):
            return self.intra_latency, self.intra_bandwidth
        return self.inter_latency, self.inter_bandwidth

    def inside(self, span: int, ranks_on_node: int = 1) -> bool:
        """Whether a group spanning ``span`` consecutive ranks fits one node (of its devices or
        of the ``ranks_on_node`` sharing it)."""
        return span <= max(self.devices_per_node, ranks_on_node)

    def ranks_per_core(self, ranks_on_node: int) -> float:
        """How many ranks share each core when ``ranks_on_node`` ranks run on a node whose
        devices share its cores (``node_flops``); 1 otherwise or when they fit."""
        if self.node_flops <= 0:
            return 1.0
        return max(1.0, ranks_on_node * self.flops_fp32 / self.node_flops)

    def crowd(self, ranks_on_node: int) -> float:
        """The factor by which a rank's work stretches when ``ranks_on_node`` ranks share a
        node's cores: ``x (1 + crowding (x - 1))`` for ``x`` ranks per core (1 when each rank
        has a core of its own, and on GPUs)."""
        x = self.ranks_per_core(ranks_on_node)
        return x * (1.0 + self.crowding * (x - 1.0))

    def with_world(self, world: int) -> Cluster:
        """The same hardware with enough nodes for ``world`` ranks (one node if it fits)."""
        nodes = max(1, -(-world // self.devices_per_node))
        return dataclasses.replace(self, nodes=nodes)


_DGX_A100 = Cluster(
    name="a100-80g",
    nodes=1,
    devices_per_node=8,
    memory_gib=80.0,
    flops=312e12,
    flops_fp32=19.5e12,
    efficiency=0.6,
    intra_bandwidth=240e9,
    intra_latency=5e-6,
    inter_bandwidth=25e9,
    inter_latency=10e-6,
)

PRESETS: dict[str, Cluster] = {
    "a100-80g": _DGX_A100,
    "h100-80g": dataclasses.replace(
        _DGX_A100,
        name="h100-80g",
        flops=989e12,
        flops_fp32=67e12,
        intra_bandwidth=400e9,
        inter_bandwidth=50e9,
    ),
    "h200-141g": dataclasses.replace(
        _DGX_A100,
        name="h200-141g",
        memory_gib=141.0,
        flops=989e12,
        flops_fp32=67e12,
        intra_bandwidth=400e9,
        inter_bandwidth=50e9,
    ),
    # a 2-core machine as `tessera plan --calibrate` measured it (rounded), one device per core here
    "cpu": Cluster(
        name="cpu",
        nodes=1,
        devices_per_node=os.cpu_count() or 1,
        memory_gib=2.94,
        # two `tessera plan --calibrate` runs on the idle machine, 2026-12-01 (rounded, between them)
        flops=1.19e11,  # bf16 (AVX512-BF16): 1.6x the fp32 rate of the same profile here
        flops_fp32=7.5e10,
        efficiency=1.0,
        node_flops=1.5e11,
        # Links: five `tessera plan --calibrate` runs after Tessera's CPU collectives and
        # messages moved to shared memory (2026-12-01, third session; rounded between the
        # runs that agreed): an all-reduce in shared memory 15-22 us and 5.4-6.0 GB/s (two
        # runs 1.8-1.9 GB/s: the first after an idle spell)
        intra_bandwidth=5.5e9,
        # the latency as a step meets it: a small all-reduce between computations, half the
        # time it adds (2026-12-05, a 2-core AMD EPYC: 56-71 us; back to back 20-43 us)
        intra_latency=60e-6,
        # the same all-reduce over gloo's loopback sockets (what a group across hosts uses;
        # a real network is slower): 0.12-0.29 ms, 0.76-1.7 GB/s (one fit failed)
        inter_bandwidth=0.9e9,
        inter_latency=250e-6,
        op_overhead_s=7.0e-6,
        # 4 processes stepping a small GPT on the 2 cores against 2 of them: 2 (1 + crowding)
        # times the step (2026-12-05, the AMD EPYC: 0.05-0.23 over eight runs, most 0.07-0.13)
        crowding=0.1,
        # tessera.comm.all_to_all on 2 processes (shared memory, with the stack and concat
        # around it): 57-111 us, 1.5-1.7 GB/s
        a2a_latency=8e-5,
        a2a_bandwidth=1.6e9,
        # a message through the shared-memory FIFOs (tessera.comm.shm_p2p): 37 us, 2.4-12.6
        # GB/s (the large message's time varies with page faults; the low end kept)
        p2p_latency=37e-6,
        p2p_bandwidth=3e9,
        shm_slots_bytes=SLOTS_BYTES,
        # a split backward (B + W) over one full backward of three GPT blocks and the head:
        # 0.16-0.27 from `tessera plan --calibrate`'s probe, 0.19-0.20 from the costs the
        # pipeline bench fitted to its steps (2026-12-01, fifth session)
        split_overhead=0.2,
        memory_bandwidth=25e9,
        host_bandwidth=25e9,
        host_memory_bandwidth=25e9,
        overlap=0.0,
    ),
}


def _from_mapping(data: dict[str, Any], where: str) -> Cluster:
    preset = str(data.pop("preset", ""))
    if preset and preset not in PRESETS:
        raise ValueError(f"{where}: unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(data) - known)
    if unknown:
        hint = (
            "; wait_s gave way to crowding: run `tessera plan --calibrate` again"
            if "wait_s" in unknown
            else ""
        )
        raise ValueError(f"{where}: unknown cluster field(s) {unknown}; known: {sorted(known)}{hint}")
    return dataclasses.replace(PRESETS[preset] if preset else Cluster(), **data)


def load_cluster(spec: str) -> Cluster:
    """A preset by name, or a TOML file with a ``[cluster]`` table of `Cluster` fields (and
    optionally ``preset = "a100-80g"`` to start from one; ValueError naming an unknown preset
    or field)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"cluster {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a file")
    with path.open("rb") as fh:
        doc = tomllib.load(fh)
    table = doc.get("cluster")
    if not isinstance(table, dict):
        raise ValueError(f"{spec}: needs a [cluster] table")
    return _from_mapping(dict(table), spec)


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: JSON's escapes of quotes, backslashes and control
    characters are TOML's, and DEL, which JSON leaves as it is, is escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def cluster_to_toml(cluster: Cluster) -> str:
    """The ``[cluster]`` table `load_cluster` reads back to ``cluster``."""
    lines = ["[cluster]"]
    for f in fields(cluster):
        value = getattr(cluster, f.name)
        lines.append(
            f"{f.name} = {_toml_string(value)}" if isinstance(value, str) else f"{f.name} = {value!r}"
        )
    return "\n".join(lines) + "\n"


def calibrated_path(env: Mapping[str, str] | None = None) -> Path:
    """Where ``tessera plan --calibrate`` writes this machine's cluster by default and where
    ``parallel.auto`` looks for it: ``$XDG_CONFIG_HOME/tessera/cluster.toml`` (XDG_CONFIG_HOME
    defaults to ``~/.config``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "tessera" / "cluster.toml"


def resolve_cluster(spec: str, env: Mapping[str, str] | None = None) -> Cluster:
    """The cluster ``parallel.cluster = spec`` names: a preset or a TOML file (`load_cluster`),
    or, when ``spec`` is empty, the calibrated file at `calibrated_path` if it exists, else the
    ``cpu`` preset. ValueError naming the spec when it is neither a preset nor a readable file."""
    if spec:
        return load_cluster(spec)
    path = calibrated_path(env)
    return load_cluster(str(path)) if path.is_file() else PRESETS["cpu"]
