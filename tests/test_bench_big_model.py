"""``hatch run bench big-model`` at a tiny size, so the benchmark cannot rot: a Llama-style
model built on the meta device, loaded from the sharded checkpoint the bench writes, trained
3 steps with its states in chunks on disk and exported, on 2 real processes (its disk chunks
stepped in backward, and at ``step()``), beside FSDP2's ladder. The figures are the
benchmark's business; here every line is well formed, the export holds every parameter in
its shape, the loss falls on the repeated batch, the model's states were placed on disk, and
both forms of the step give the same losses and exported bytes while stepping in backward
writes less."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--vocab", "96", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq", "16"]


@pytest.mark.slow
def test_the_big_model_bench_runs_tiny(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "big-model",
        *TINY,
        "--peer-sizes",
        "32:1,32:2",
    ]
    cmd += ["--systems", "tessera,tessera-at-step,fsdp2-offload", "--probe-mib", "8"]
    cmd += ["--host-budget-mib", "0.01"]
    cmd += ["--disk-dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    by = {}
    for r in lines:
        by.setdefault(r["system"], []).append(r)
    (disk,) = by["disk"]
    assert disk["disk_write_gbps"] > 0 and disk["disk_read_gbps"] > 0
    (ours,) = by["tessera"]
    assert "error" not in ours, ours
    assert ours["export_check"] == "ok", ours
    assert ours["world"] == 2 and ours["fits_cap"] and ours["loss_last"] < ours["loss_first"], ours
    assert ours["disk_chunk_mb"] > 0 and {"disk_read_gbps", "disk_busy", "disk_busy_block"} <= set(ours), ours
    (forms,) = by["step-in-backward"]  # disk chunks stepped in backward, against at step()
    assert forms["same_losses"] and forms["same_export"], forms
    assert 0 < forms["disk_written_per_step"] < forms["disk_written_per_step_at_step"], forms
    ladder, summary = by["fsdp2-offload"][:-1], by["fsdp2-offload"][-1]
    assert [r["params"] for r in ladder] == sorted(r["params"] for r in ladder) and len(ladder) == 2, ladder
    assert all(r["loss_last"] < r["loss_first"] for r in ladder), ladder
    assert summary["largest_params"] == ladder[-1]["params"] == ours["params"], summary
    (goals,) = by["goals"]
    assert goals["tessera_params"] == ours["params"] and goals["ratio_vs_peers"] == 1.0, goals
    assert goals["goal_params_1e9"] is False and goals["goal_ratio_3x"] is False, goals
    assert not any(tmp_path.iterdir()), "the bench left files behind"
