"""``tessera plan --calibrate``: measure this machine and describe it as a `Cluster`.

Times, in this process with one thread per rank as the launcher's workers run
(``OMP_NUM_THREADS=1``): forward and backward of the reference GPT at a tiny and a medium
size (a short profile of the model itself), fitted to the planner's own compute model
``t = FLOPs / rate + operators * overhead`` (two sizes, two unknowns: the sustained FLOP/s
of one rank and the fixed cost per operator); a large copy (memory bandwidth); and, between
two gloo processes over loopback, all-reduces of a small and a large tensor, fitted to the
alpha-beta model (a 2-rank ring all-reduce takes ``2 latency + bytes / bandwidth``), and a
small all-reduce among twice as many processes as cores, for the wait each message adds per
rank beyond the cores (``wait_s``: a peer must be scheduled before it answers); and
all-to-alls (``tessera.comm.all_to_all``, what Ulysses runs) of the same two sizes on two
processes, fitted to ``a2a_latency + bytes / 2 / a2a_bandwidth`` (gloo's all-to-all costs
about an all-reduce of the same buffer, not the half the ring form says). The
medium profile runs again with bf16 parameters for the bf16 rate (``flops``; CPUs with
AVX512-BF16 or AMX run it faster than fp32). The node's FLOP/s are one rank's fp32 rate
times the cores (ranks beyond the cores share them).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tessera.launcher.plan.cluster import GIB, PRESETS, Cluster

__all__ = ["calibrate"]

SMALL, LARGE = 256, 4 * 2**20  # bytes of the two all-reduces


def _median(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collective_worker(
    rank: int, world: int, path: str, sizes: tuple[int, ...], out: Any, op: str = "all_reduce"
) -> None:
    import torch
    import torch.distributed as dist

    from tessera.comm import all_to_all

    torch.set_num_threads(1)
    store = dist.FileStore(path, world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)

            def reduce(x: torch.Tensor = x) -> None:
                if op == "all_to_all":
                    all_to_all(x.view(world, -1))
                else:
                    dist.all_reduce(x)

            result.append(_median(reduce, 20 if nbytes == LARGE else 200))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def _all_reduce_times(world: int, sizes: tuple[int, ...], op: str = "all_reduce") -> list[float]:
    """Median seconds of gloo all-reduces (or ``op="all_to_all"``: tessera all-to-alls) of
    ``sizes`` bytes among ``world`` processes here."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tessera-calibrate-") as tmp:
        queue = ctx.Queue()
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_collective_worker, args=(r, world, store, sizes, queue, op))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        times: list[float] = queue.get(timeout=300)
        for p in procs:
            p.join(60)
    return times


def _all_to_all() -> tuple[float, float]:
    """(a2a_latency s, a2a_bandwidth B/s): two processes time all-to-alls of a small and a
    large buffer, fitted to ``latency + bytes / 2 / bandwidth`` (half the buffer leaves)."""
    small, large = _all_reduce_times(2, (SMALL, LARGE), op="all_to_all")
    bandwidth = (LARGE - SMALL) / 2 / max(large - small, 1e-9)
    return max(small - SMALL / 2 / bandwidth, 1e-7), bandwidth


def _link(cores: int) -> tuple[float, float, float]:
    """(latency s, bandwidth B/s, wait s) of loopback gloo: two processes fit the alpha-beta
    model (a 2-rank ring all-reduce takes ``2 latency + bytes / bandwidth``); then ``2 cores``
    processes, twice as many as the cores, time a small all-reduce (``2 (n - 1)`` ring steps),
    whose steps each wait ``wait`` more per rank beyond the cores (``cores`` of them)."""
    small, large = _all_reduce_times(2, (SMALL, LARGE))
    bandwidth = (LARGE - SMALL) / max(large - small, 1e-9)
    latency = max((small - SMALL / bandwidth) / 2, 1e-7)
    n = 2 * cores
    (crowded,) = _all_reduce_times(n, (SMALL,))
    per_step = crowded / (2 * (n - 1))
    wait = max(per_step - latency - SMALL / n / bandwidth, 0.0) / cores
    return latency, bandwidth, wait


def _profile(layers: int, hidden: int, seq: int, rows: int, bf16: bool = False) -> tuple[float, float, float]:
    """(seconds, FLOPs, operators) of one forward + backward of the reference GPT (its
    parameters in bf16 when ``bf16``, as a bf16 job computes)."""
    import torch

    from tessera.launcher.plan.estimate import OPS_EDGE, OPS_LAYER
    from tessera.launcher.plan.model import ModelShape
    from tessera.models import GPT, GPTConfig, make_batch

    cfg = GPTConfig(vocab_size=128, seq_len=seq, d_model=hidden, n_heads=4, n_layers=layers)
    model = GPT(cfg, seed=0)
    if bf16:
        model = model.to(torch.bfloat16)
    idx, targets = make_batch(cfg, rows, seed=0)

    def step() -> None:
        model.loss(idx, targets).backward()  # type: ignore[no-untyped-call]

    seconds = _median(step, 10)
    spec = ModelShape(layers=layers, hidden=hidden, heads=4, vocab=128, seq=seq, batch=rows)
    flops = spec.step_flops()
    return seconds, flops, 3.0 * (layers * OPS_LAYER + 2 * OPS_EDGE)


def calibrate() -> Cluster:
    """Measure this machine (a few seconds; spawns two gloo processes) as a `Cluster`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t1, f1, o1 = _profile(2, 16, 8, 1)  # launches dominate
        t2, f2, o2 = _profile(2, 256, 128, 8)  # FLOPs dominate
        # t = f / rate + o * op  =>  solve for (1 / rate, op), each kept positive
        det = f1 * o2 - f2 * o1
        inv_rate = (t1 * o2 - t2 * o1) / det if det else 0.0
        inv_rate = inv_rate if inv_rate > 0 else t2 / f2
        op = max((t1 - f1 * inv_rate) / o1, 1e-7)
        flops = 1.0 / inv_rate
        t3, f3, o3 = _profile(2, 256, 128, 8, bf16=True)  # the same work in bf16 (AMX / AVX512-BF16)
        flops_bf16 = f3 / max(t3 - o3 * op, 0.1 * t3)
        big = torch.empty(16 * 2**20 // 4)
        memory_bw = 2 * big.numel() * 4 / _median(lambda: big.clone(), 20)  # read + write
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    latency, bandwidth, wait = _link(cores)
    a2a_latency, a2a_bandwidth = _all_to_all()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    base = PRESETS["cpu"]
    return Cluster(
        name="cpu-calibrated",
        nodes=1,
        devices_per_node=base.devices_per_node,
        memory_gib=round(total / GIB / base.devices_per_node, 2),
        flops=flops_bf16,
        flops_fp32=flops,
        efficiency=1.0,
        node_flops=flops * cores,
        intra_bandwidth=bandwidth,
        intra_latency=latency,
        inter_bandwidth=bandwidth,
        inter_latency=latency,
        op_overhead_s=op,
        memory_bandwidth=memory_bw,
        host_bandwidth=memory_bw,
        host_memory_bandwidth=memory_bw,
        overlap=0.0,
        wait_s=wait,
        a2a_latency=a2a_latency,
        a2a_bandwidth=a2a_bandwidth,
    )
