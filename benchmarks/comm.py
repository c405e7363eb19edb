"""Collectives on 2 gloo ranks (``--world``): Tessera's typed, metered, non-mutating
collectives beside the raw torch.distributed calls (system "torch-c10d") on the same
buffers, in one run.

Sizes are the full buffer in MiB of fp32: the all-reduce buffer, the all-gather's output, the
reduce-scatter's input (1 and 25 MiB by default: a small bucket and a ZeRO/DDP-sized one).
On gloo, Tessera's all-gather and reduce-scatter run its own p2p ring
(``tessera.comm.gloo_ring``); torch's gloo reduce-scatter all-reduces a copy of its input.
A "token" here is one fp32 element reduced or gathered, so tokens_per_s is elements/s.
``all_reduce`` is Tessera's default, which returns a new tensor (a clone of the input,
reduced); ``all_reduce_inplace`` is ``all_reduce(x, inplace=True)``, which reduces ``x``
itself as torch's call does (what Tessera's internal callers use where the input is theirs).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import emit, table

from tessera.comm import CommMeter, all_gather, all_reduce, reduce_scatter
from tessera.comm.testing import WorkerPool

OPS = ("all_reduce", "all_reduce_inplace", "all_gather", "reduce_scatter")


def _bench(rank: int, op: str, numel: int, iters: int) -> dict[str, Any]:
    n = dist.get_world_size()
    x = torch.randn(numel)
    shard = torch.randn(numel // n)
    out_full = torch.empty(numel)
    out_shard = torch.empty(numel // n)
    tessera_step: Callable[[], object] = {
        "all_reduce": lambda: all_reduce(x),
        "all_reduce_inplace": lambda: all_reduce(x, inplace=True),
        "all_gather": lambda: all_gather(shard),
        "reduce_scatter": lambda: reduce_scatter(x),
    }[op]
    torch_step: Callable[[], object] = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_reduce_inplace": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_single(out_full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(out_shard, x),
    }[op]
    with CommMeter() as meter:
        tessera_step()
    steps = {"tessera": tessera_step, "torch-c10d": torch_step}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(3 + iters):  # alternating (ABBA), so background load hits both alike
        for name, step in steps.items() if i % 2 == 0 else reversed(steps.items()):
            t0 = time.perf_counter()
            step()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()} | {"comm_bytes": meter.volume_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, nargs="+", default=[1.0, 25.0], help="buffer sizes, MiB")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    records = []
    with WorkerPool(args.world, timeout=600) as pool:
        for op in OPS:
            for mib in args.mib:
                numel = int(mib * (1 << 20)) // 4 // args.world * args.world
                result = pool.run(_bench, op, numel, args.iters)[0]
                for system in ("tessera", "torch-c10d"):
                    t = result[system]
                    rec = {
                        "bench": "comm",
                        "system": system,
                        "config": f"{op} world={args.world} {mib:g} MiB numel={numel} fp32 gloo",
                        "step_time_s": round(t, 6),
                        "tokens_per_s": round(numel / t, 1),
                        "comm_bytes": result["comm_bytes"],
                        "ratio_vs_peer": None,
                    }
                    records.append(rec)
                records[-2]["ratio_vs_peer"] = round(result["torch-c10d"] / result["tessera"], 3)
    for rec in records:
        emit(rec)
    table(records, ("system", "config", "step_time_s", "ratio_vs_peer"))


if __name__ == "__main__":
    main()
