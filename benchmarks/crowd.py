"""What ranks sharing this host's cores cost: the same compute with more or fewer
synchronizations, at one, two and four ranks per core.

Every rank of a gloo worker pool (``LOCAL_WORLD_SIZE`` set, so waits poll or sleep as in a
job) multiplies 128 x 128 matrices ``--units`` times and, spread evenly through them,
all-reduces 8 floats (``tessera.comm.all_reduce``: shared memory here) within its group of
``g`` consecutive ranks, ``n`` times, each point ``--repeats`` times (the least disturbed repeat kept: the one
whose slowest rank was fastest). One JSON line per (world, g, n): ``step_time_s`` (the
run's wall time on the slowest rank), ``cpu_per_rank_s`` (process CPU, every thread; mean over ranks) and
``ranks_per_core``. Then per (world, g) a summary: ``per_sync_wall_s``, the wall time one
more synchronization adds (the slope between the fewest and the most ``n``), and
``per_sync_extra_s``, what it adds per rank beyond the same synchronization at one rank per
core (``per_sync_wall_s / ranks_per_core`` less the one-rank-per-core slope, of the same ``g``
where it was measured, else of the largest group measured: a shared-memory call costs about
the same among 2 or 8 ranks); and ``crowd_few_syncs``, the wall time with the fewest
synchronizations over the one-rank-per-core run's, divided by the ranks per core (1: sharing
costs only the share).

How the planner reads it: `tessera.planner.Cluster.crowd` stretches a rank's whole work by
``x (1 + crowding (x - 1))``; this bench says how much of that is a cost per
synchronization (a collective that waits for a peer whose core runs another rank) rather
than a share of the work.

``hatch run bench crowd`` (``--worlds``, ``--groups``, ``--syncs``, ``--units``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from _common import cpu_s, emit

from tessera.comm.testing import WorkerPool


def _rank(
    rank: int, world: int, groups: list[int], syncs: list[int], units: int, repeats: int
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from tessera.comm import all_reduce

    torch.set_num_threads(1)
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(rank))
    flag = torch.zeros(8)
    out = []
    for g in groups:
        made = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]
        group = made[rank // g]
        all_reduce(flag, group, inplace=True)  # the segment is set up outside the timing
        for n in syncs:
            per = units // n
            runs = []
            for _ in range(repeats):
                dist.barrier()
                cpu0, t0 = cpu_s(), time.perf_counter()
                for _ in range(n):
                    for _ in range(per):
                        a @ a
                    all_reduce(flag, group, inplace=True)
                runs.append((time.perf_counter() - t0, cpu_s() - cpu0))
            out.append({"g": g, "n": n, "walls": [w for w, _ in runs], "cpus": [c for _, c in runs]})
    return out


def _least(per_rank: list[list[dict[str, Any]]], i: int) -> tuple[float, float]:
    """(wall, CPU per rank) of row ``i``'s least disturbed repeat: the one whose slowest rank
    was fastest (other work on the machine only adds time)."""
    repeats = len(per_rank[0][i]["walls"])
    best = min(range(repeats), key=lambda k: max(r[i]["walls"][k] for r in per_rank))
    wall = max(r[i]["walls"][best] for r in per_rank)
    return wall, statistics.fmean(r[i]["cpus"][best] for r in per_rank)


def main() -> None:
    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--worlds", default=f"{cores},{2 * cores},{4 * cores}", help="comma-separated world sizes"
    )
    ap.add_argument(
        "--groups", default="2,world", help="comma-separated group sizes ('world': the whole world)"
    )
    ap.add_argument("--syncs", default="10,400,1000", help="comma-separated synchronizations per run")
    ap.add_argument("--units", type=int, default=8000, help="128x128 matmuls per rank and run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each point; the least disturbed is kept")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    syncs = sorted(int(n) for n in args.syncs.split(","))
    if min(worlds) < 2 or min(syncs) < 1 or args.units < max(syncs) or args.repeats < 1:
        raise SystemExit(
            f"need worlds >= 2, syncs >= 1 and units >= syncs: {args.worlds}, {args.syncs}, {args.units}"
        )
    slopes: dict[tuple[float, int], float] = {}  # (ranks per core, g) -> per-sync wall seconds
    lone: dict[int, float] = {}  # g -> wall with the fewest syncs at one rank per core
    for world in worlds:
        groups = sorted({world if g == "world" else int(g) for g in args.groups.split(",")})
        groups = [g for g in groups if 1 < g <= world and world % g == 0]
        x = max(1.0, world / cores)
        with WorkerPool(world, timeout=900) as pool:
            per_rank = pool.run(_rank, world, groups, syncs, args.units, args.repeats, timeout=900)
        for i, row in enumerate(per_rank[0]):
            wall, cpu = _least(per_rank, i)
            emit(
                {
                    "bench": "crowd",
                    "system": "tessera",
                    "config": f"world={world} group={row['g']} syncs={row['n']}",
                    "ranks_per_core": x,
                    "step_time_s": round(wall, 4),  # the whole run: compute and syncs
                    "tokens_per_s": 0.0,
                    "cpu_per_rank_s": round(cpu, 4),
                }
            )
        for g in groups:
            rows = [i for i, row in enumerate(per_rank[0]) if row["g"] == g]
            walls = [_least(per_rank, i)[0] for i in rows]
            slope = (walls[-1] - walls[0]) / (syncs[-1] - syncs[0]) if len(syncs) > 1 else float("nan")
            slopes[(x, g)] = slope
            if x == 1.0:
                lone[g] = walls[0]
            alone = [slopes[(y, h)] for (y, h) in sorted(slopes) if y == 1.0]  # largest group last
            base = slopes.get((1.0, g), alone[-1] if alone else None)
            first = next(iter(lone.values()), None)
            emit(
                {
                    "bench": "crowd",
                    "system": "tessera",
                    "config": f"world={world} group={g} summary",
                    "ranks_per_core": x,
                    "step_time_s": 0.0,
                    "tokens_per_s": 0.0,
                    "per_sync_wall_s": round(slope, 7),
                    "per_sync_extra_s": None if base is None else round(slope / x - base, 7),
                    "crowd_few_syncs": None if first is None else round(walls[0] / first / x, 3),
                }
            )


if __name__ == "__main__":
    main()
