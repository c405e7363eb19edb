"""``tessera plan --calibrate``: measure this machine and describe it as a `Cluster`.

Times, in this process with one thread per rank as the launcher's workers run
(``OMP_NUM_THREADS=1``): forward and backward of the reference GPT at a tiny and a medium
size (a short profile of the model itself), fitted to the planner's own compute model
``t = FLOPs / rate + operators * overhead`` (two sizes, two unknowns: the sustained FLOP/s
of one rank and the fixed cost per operator); a large copy (memory bandwidth); and, between
two gloo processes on this host, Tessera's own collectives as a job runs them:

- all-reduces (``tessera.comm.all_reduce``, in place: shared memory here, `tessera.comm.shm`)
  of a large tensor back to back, for the bandwidth, and of a small one with computation
  between them as a step runs them (the time the pair takes less the computation alone),
  for the latency (a 2-rank all-reduce takes ``2 latency + bytes / bandwidth``): the link
  inside the node;
- the same with shared memory off (gloo over loopback sockets): the link between nodes, for
  want of a second host (a real network is slower);
- point-to-point messages (``tessera.comm.batch_isend_irecv``: shared-memory FIFOs here,
  `tessera.comm.shm_p2p`) of the same two sizes, one way and back, fitted to ``p2p_latency + bytes /
  p2p_bandwidth`` a way (pipeline hops and ring attention);
- steps of a small GPT (forward, backward, a small all-reduce) on as many processes as
  cores and then on twice as many, for what each extra rank per core costs beyond its share
  of the cores (``crowding``: the step takes ``2 (1 + crowding)`` times as long);
- all-to-alls (``tessera.comm.all_to_all``, what Ulysses runs) of the two sizes, fitted to
  ``a2a_latency + bytes / 2 / a2a_bandwidth`` (half the buffer leaves);
- in this process, a pipeline stage's backward split into B and W (zero-bubble) against one
  full backward (``split_overhead``, the fraction the split adds). The
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

from tessera.planner.cluster import GIB, PRESETS, Cluster

__all__ = ["calibrate"]

SMALL, LARGE = 256, 4 * 2**20  # bytes of the two all-reduces


def _median(fn: Callable[[], object], iters: int, budget_s: float = float("inf")) -> float:
    """Median seconds of ``iters`` calls of ``fn`` after one untimed; fewer (at least 3) when
    that first call says ``iters`` would take more than ``budget_s`` (a bf16 profile on a
    CPU without bf16 arithmetic takes seconds a call)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first * iters > budget_s:
        iters = max(min(iters, 3), int(budget_s / max(first, 1e-9)))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collective_worker(rank: int, world: int, path: str, sizes: tuple[int, ...], op: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import FileStore  # dist.FileStore, typed

    from tessera.comm import all_reduce, all_to_all, batch_isend_irecv, share_memory

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun says: waits poll as in a job
    if op == "gloo_all_reduce":
        os.environ["TESSERA_SHM"] = "0"
    store = FileStore(path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        share_memory(None)  # as the pipeline runtime does: messages take the host's shared memory
        result = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            peer = (rank + 1) % world

            def run(x: torch.Tensor = x, peer: int = peer) -> None:
                if op == "all_to_all":
                    all_to_all(x.view(world, -1))
                elif op == "p2p":  # rank 0 sends, rank 1 returns it: two messages
                    first, second = (x, torch.empty_like(x)) if rank == 0 else (torch.empty_like(x), x)
                    if rank == 0:
                        batch_isend_irecv([(first, peer)], []).wait()
                        batch_isend_irecv([], [(second, peer)]).wait()
                    else:
                        batch_isend_irecv([], [(first, peer)]).wait()
                        batch_isend_irecv([(first, peer)], []).wait()
                else:
                    all_reduce(x, inplace=True)

            run()  # the first call sets the transport up
            if op == "between":  # computing between all-reduces, as a step does: the extra
                a = torch.randn(96, 96)  # time an all-reduce adds to the same compute

                def compute(a: torch.Tensor = a) -> None:
                    for _ in range(8):
                        a @ a

                def both() -> None:
                    compute()
                    run()

                dist.barrier()
                alone = _median(compute, 100)
                dist.barrier()
                result.append(max(_median(both, 100) - alone, 0.0))
                continue
            result.append(_median(run, 20 if nbytes == LARGE else 200))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def _all_reduce_times(world: int, sizes: tuple[int, ...], op: str = "all_reduce") -> list[float]:
    """Median seconds of Tessera's in-place all-reduces (``op="gloo_all_reduce"``: with shared
    memory off; ``"between"``: with computation between them, less the computation;
    ``"all_to_all"``: all-to-alls; ``"p2p"``: a message there and back) of ``sizes`` bytes
    among ``world`` gloo processes here."""
    return _spawn(_collective_worker, world, sizes, op)


def _small_and_large(op: str, tries: int = 3) -> tuple[float, float]:
    """Median seconds of ``op`` (`_all_reduce_times`) on ``SMALL`` and on ``LARGE`` bytes
    between two processes. A large call no slower than a small one says other work disturbed
    the small one's timing (its fit would give an absurd bandwidth): it is measured again, up
    to ``tries`` times, then RuntimeError naming the times."""
    small = large = 0.0
    for _ in range(tries):
        small, large = _all_reduce_times(2, (SMALL, LARGE), op=op)
        if large > small:
            return small, large
    raise RuntimeError(
        f"calibration: {op} of {LARGE} bytes took {large:.6f} s, no longer than of {SMALL} bytes "
        f"({small:.6f} s), {tries} times: other work on this machine disturbs the timing; "
        "calibrate again when it is quiet"
    )


def _all_to_all() -> tuple[float, float]:
    """(a2a_latency s, a2a_bandwidth B/s): two processes time all-to-alls of a small and a
    large buffer, fitted to ``latency + bytes / 2 / bandwidth`` (half the buffer leaves)."""
    small, large = _small_and_large("all_to_all")
    bandwidth = (LARGE - SMALL) / 2 / (large - small)
    return max(small - SMALL / 2 / bandwidth, 1e-7), bandwidth


def _fit(op: str, passes: int) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of ``op`` on two processes, from a call of the small and of
    the large size, each taking ``2 latency + passes * bytes / bandwidth``: an all-reduce
    (``passes`` 1, the alpha-beta model's 2-rank form) or a message there and back (2)."""
    small, large = _small_and_large(op)
    bandwidth = passes * (LARGE - SMALL) / (large - small)
    return max((small - passes * SMALL / bandwidth) / 2, 1e-7), bandwidth


def _link() -> tuple[float, float]:
    """(latency s, bandwidth B/s) of Tessera's all-reduce here: the bandwidth from `_fit`'s
    back-to-back calls, the latency from a small all-reduce between computations, as a step
    runs it (the wrappers' Python, the handshake and cold caches: several times the latency
    of back-to-back calls), half of which is one latency (a 2-rank all-reduce pays two)."""
    _, bandwidth = _fit("all_reduce", 1)
    (between,) = _all_reduce_times(2, (SMALL,), op="between")
    return max((between - SMALL / bandwidth) / 2, 1e-7), bandwidth


def _crowd_worker(rank: int, world: int, path: str, out: Any) -> None:
    """Ranks stepping a small reference GPT (forward, backward, a small all-reduce, as a
    data-parallel rank steps): the first half alone (the others wait in a barrier), then all
    of them, three times over; rank 0 puts the median of the crowded step's seconds over
    the lone step's."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import FileStore  # dist.FileStore, typed

    from tessera.comm import all_reduce
    from tessera.models import GPT, GPTConfig, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=FileStore(path, world), rank=rank, world_size=world)
    try:
        half = world // 2
        first = dist.new_group(list(range(half)))
        cfg = GPTConfig(vocab_size=128, seq_len=64, d_model=128, n_heads=4, n_layers=2)
        model = GPT(cfg, seed=0)
        idx, targets = make_batch(cfg, 4, seed=rank)
        flag = torch.zeros(8)

        def step(group: Any = None) -> None:
            torch.autograd.backward(model.loss(idx, targets))
            all_reduce(flag, group, inplace=True)

        ratios = []
        for _ in range(3):
            os.environ["LOCAL_WORLD_SIZE"] = str(half)  # as torchrun says: waits poll as in a job
            alone = _median(lambda: step(first), 15) if rank < half else 0.0
            dist.barrier()
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
            crowded = _median(step, 15)
            dist.barrier()
            ratios.append(crowded / alone if alone else 0.0)
        if rank == 0:
            out.put([statistics.median(ratios)])
    finally:
        dist.destroy_process_group()


def _spawn(target: Callable[..., None], world: int, *args: object) -> list[float]:
    """What rank 0 of ``world`` gloo processes running ``target(rank, world, store, *args,
    queue)`` here puts on the queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tessera-calibrate-") as tmp:
        queue = ctx.Queue()
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, store, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result: list[float] = queue.get(timeout=300)
        for p in procs:
            p.join(60)
    return result


def _crowding(cores: int) -> float:
    """`Cluster.crowding`: ``cores`` processes, one per core, and then twice as many, each
    stepping a small GPT (`_crowd_worker`); twice the ranks per core take ``2 (1 +
    crowding)`` times as long a step."""
    (ratio,) = _spawn(_crowd_worker, 2 * cores)
    return max(ratio / 2 - 1.0, 0.0)


def _profile(layers: int, hidden: int, seq: int, rows: int, bf16: bool = False) -> tuple[float, float, float]:
    """(seconds, FLOPs, operators) of one forward + backward of the reference GPT (its
    parameters in bf16 when ``bf16``, as a bf16 job computes)."""
    import torch

    from tessera.models import GPT, GPTConfig, make_batch
    from tessera.planner.model import ModelShape
    from tessera.planner.operators import OPS_EDGE, OPS_LAYER

    cfg = GPTConfig(vocab_size=128, seq_len=seq, d_model=hidden, n_heads=4, n_layers=layers)
    model = GPT(cfg, seed=0)
    if bf16:
        model = model.to(torch.bfloat16)
    idx, targets = make_batch(cfg, rows, seed=0)

    def step() -> None:
        torch.autograd.backward(model.loss(idx, targets))  # Tensor.backward is unannotated

    seconds = _median(step, 10, budget_s=3.0)
    spec = ModelShape(layers=layers, hidden=hidden, heads=4, vocab=128, seq=seq, batch=rows)
    flops = spec.step_flops()
    return seconds, flops, 3.0 * (layers * OPS_LAYER + 2 * OPS_EDGE)


def _split_overhead(layers: int = 3, hidden: int = 128, seq: int = 64, rows: int = 4) -> float:
    """What a zero-bubble split backward (B, then W: `tessera.pipeline.split_backward`) costs
    beyond one full backward, as a fraction of it: a pipeline stage of ``layers`` blocks of
    the reference GPT and its head, from an input that needs a gradient (medians)."""
    import torch

    from tessera.models import GPT, GPTConfig, make_batch
    from tessera.pipeline.split_backward import backward_input, grad_nodes

    cfg = GPTConfig(vocab_size=512, seq_len=seq, d_model=hidden, n_heads=4, n_layers=layers)
    blocks = GPT(cfg, seed=0).blocks()
    embed, stage = blocks[0], torch.nn.Sequential(*blocks[1:])
    idx, targets = make_batch(cfg, rows, seed=0)
    params = [q for q in stage.parameters() if q.requires_grad]
    nodes = grad_nodes(params)

    def loss() -> tuple[torch.Tensor, torch.Tensor]:
        x = embed(idx).detach().requires_grad_()
        logits = stage(x)
        return x, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def timed(split: bool) -> float:
        x, out = loss()
        t0 = time.perf_counter()
        if split:
            _, weights = backward_input(out, None, x, params, nodes)
            weights.run()
        else:
            torch.autograd.backward(out)
        return time.perf_counter() - t0

    for _ in range(3):  # warm up both
        timed(True)
        timed(False)
    whole = statistics.median(timed(False) for _ in range(15))
    split = statistics.median(timed(True) for _ in range(15))
    return max(split / whole - 1.0, 0.0)


def calibrate() -> Cluster:
    """Measure this machine (a few seconds; spawns two gloo processes) as a `Cluster`."""
    import torch

    from tessera.comm import shm

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
        split_overhead = _split_overhead()
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    latency, bandwidth = _link()
    crowding = _crowding(cores)
    inter_latency, inter_bandwidth = _fit("gloo_all_reduce", 1)
    p2p_latency, p2p_bandwidth = _fit("p2p", 2)
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
        inter_bandwidth=inter_bandwidth,
        inter_latency=inter_latency,
        p2p_latency=p2p_latency,
        p2p_bandwidth=p2p_bandwidth,
        shm_slots_bytes=float(shm.SLOTS_BYTES) if shm.SUPPORTED else 0.0,
        op_overhead_s=op,
        memory_bandwidth=memory_bw,
        host_bandwidth=memory_bw,
        host_memory_bandwidth=memory_bw,
        overlap=0.0,
        crowding=crowding,
        a2a_latency=a2a_latency,
        a2a_bandwidth=a2a_bandwidth,
        split_overhead=split_overhead,
    )
