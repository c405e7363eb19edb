"""``hatch run bench crowd`` and ``hatch run bench kernel-rates`` at a tiny size, so neither can rot:
every line is well formed and carries the figures its README entry names, one line per point
asked for. The figures themselves are the benchmarks' business."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_the_crowd_bench_runs_tiny() -> None:
    lines = _bench(
        "crowd", "--worlds", "2,4", "--groups", "2,world", "--syncs", "2,4", "--units", "8", "--repeats", "2"
    )
    points = [r for r in lines if not r["config"].endswith("summary")]
    summaries = [r for r in lines if r["config"].endswith("summary")]
    # world 2: group 2; world 4: groups 2 and 4; two sync counts each
    assert [r["config"] for r in points] == [
        f"world={w} group={g} syncs={n}" for w, g in ((2, 2), (4, 2), (4, 4)) for n in (2, 4)
    ], points
    assert all(r["step_time_s"] > 0 and r["cpu_per_rank_s"] > 0 for r in points), points
    assert [r["config"] for r in summaries] == [
        f"world={w} group={g} summary" for w, g in ((2, 2), (4, 2), (4, 4))
    ]
    assert all(isinstance(r["per_sync_wall_s"], float) and r["crowd_few_syncs"] > 0 for r in summaries), (
        summaries
    )
    assert summaries[0]["per_sync_extra_s"] == 0.0  # one rank per core is its own base


def test_a_crowd_bench_given_more_syncs_than_units_stops_before_spawning() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "crowd", "--syncs", "10", "--units", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "units >= syncs" in proc.stderr and "10" in proc.stderr, proc.stderr[
        -2000:
    ]


def test_the_kernel_rates_bench_runs_tiny() -> None:
    lines = _bench(
        "kernel-rates", "--shapes", "16x8x4", "--heads", "8,16", "--hidden", "16", "--seq", "8", "--rows", "2"
    )
    configs = [r["config"] for r in lines]
    assert configs == [
        "matmul 16x8x4 fp32",
        "matmul 16x8x4 bf16",
        *(f"attention 2x8 tokens d=16 {h} per head {p}" for h in (8, 16) for p in ("fp32", "bf16")),
        *(f"gpt d=16 {h} per head seq 8 4 rows {p}" for h in (8, 16) for p in ("fp32", "bf16")),
    ], configs
    assert all(r["step_time_s"] > 0 for r in lines), lines
    assert all(r["flops_per_s"] > 0 for r in lines[:2]), lines[:2]
    speedups = [r["bf16_speedup"] for r in lines if "bf16_speedup" in r]
    assert len(speedups) == 2 and all(s > 0 for s in speedups), lines
