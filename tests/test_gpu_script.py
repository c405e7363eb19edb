"""The GPU script (``benchmarks/gpu``) on the CPU with ``--size tiny``, so it cannot rot.

Every line it prints is a JSON object with a check name, the device and ``ok``; every check
that does not need CUDA passes (each mode against serial within the bounds of
``benchmarks/gpu/modes.py``, the MFU run's losses finite, the overlap fraction of a written
trace in [0, 1]); the ones that need CUDA are the lines skipped, exactly these. The
fresh-process runner the script uses on a GPU is exercised here on gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu.rank_probes import dies_on_rank_one, fails_on_rank_one, rank_and_sum  # noqa: E402
from gpu.ranks import RankError, run_ranks  # noqa: E402

NEEDS_CUDA = {"mode:dp2-zero3-device-tier", "mode:nccl-zero1"}
RUN_ON_CPU = (
    "cp-kernels", "mfu", "collective:reduce_scatter", "collective:ring_shift", "mode:dp2-zero3",
    "mode:tp2-sp", "mode:2d", "mode:2.5d", "mode:3d", "mode:cp2-ring", "mode:cp2-ulysses",
    "mode:pp2-1f1b", "mode:dp2-zero3-offload", "overlap:dp2-zero3", "overlap:tp2-sp",
)  # fmt: skip


@pytest.mark.slow
def test_the_gpu_script_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "run.py"), "--device", "cpu", "--size", "tiny",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all({"check", "device", "ok"} <= set(r) and r["device"] == "cpu" for r in lines), lines
    env, *checks, summary = lines
    assert env["check"] == "env" and env["torch"] == __import__("torch").__version__
    assert summary["check"] == "summary" and summary["ok"] is True and summary["failed"] == 0
    failed = [r for r in checks if r["ok"] is False]
    assert not failed, failed
    skipped = {r["check"]: r["skipped"] for r in checks if r["ok"] is None}
    assert skipped == dict.fromkeys(NEEDS_CUDA, "needs cuda")
    names = {r["check"] for r in checks}
    assert set(RUN_ON_CPU) <= names
    kernels = [r for r in checks if r["check"] == "cp-kernels"]  # the CPU's flash kernel here
    assert len(kernels) == 4 and {r["kernel"] for r in kernels} == {"cpu-flash"}
    mfu = next(r for r in checks if r["check"] == "mfu")
    assert mfu["mfu"] is None and mfu["step_time_s"] > 0  # no peak for a CPU
    for r in checks:
        if r["check"].startswith("overlap:"):
            assert Path(r["trace"]).is_file() and 0.0 <= r["overlap_fraction"] <= 1.0


def test_fresh_ranks_run_a_function_and_report_a_failure() -> None:
    assert run_ranks(2, "gloo", rank_and_sum, 10, timeout=120) == [(0, 30.0), (1, 30.0)]
    with pytest.raises(RankError, match="rank 1 of 2: ValueError: rank one refuses"):
        run_ranks(2, "gloo", fails_on_rank_one, timeout=120)
    with pytest.raises(RankError, match=r"rank 1 of 2 died \(exit code 3\)"):
        run_ranks(2, "gloo", dies_on_rank_one, timeout=120)
