"""``hatch run bench lora`` at a tiny size, so the benchmark cannot rot: Tessera LoRA and full
fine-tune (dp=2 with ZeRO-3) and torch + peft in one process, each in fresh processes, and a
DeepSpeed line that says why it did not run (an interpreter that does not exist). The figures
are the benchmark's business; here every line is well formed, the LoRA systems train the same
adapters, every system's loss falls on its repeated batch, LoRA holds fewer model-state bytes
than the full fine-tune, and Tessera's LoRA line carries its ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--vocab=256", "--dim=64", "--layers=2", "--heads=4", "--kv-heads=2", "--ffn=128", "--seq=16"]
TINY += ["--rows=4", "--lora-rank=4", "--warmup=2", "--iters=2", "--rounds=1"]


@pytest.mark.slow
def test_the_lora_bench_runs_tiny() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "lora", *TINY, "--layouts=dp2-zero3"]
    cmd += ["--python", sys.executable, "--deepspeed-python", "/nonexistent/python", "--peft-threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    by = {r["system"]: r for r in lines}
    assert list(by) == ["tessera-lora", "tessera-full", "torch-peft", "deepspeed-peft"], lines
    assert all(r["bench"] == "lora" and {"config", "step_time_s", "tokens_per_s"} <= set(r) for r in lines)
    lora, full, peft = by["tessera-lora"], by["tessera-full"], by["torch-peft"]
    for r in (lora, full, peft):
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0, r
        assert r["final_loss"] < r["first_loss"], r
        assert len(r["peak_rss_mb_per_rank"]) == (1 if r is peft else 2), r
        assert r["peak_rss_mb"] >= r["train_peak_rss_mb"] > r["base_rss_mb"] > 0, r
        assert list(r["phase_peak_rss_mb"]) == ["imports", "build", "wrap", "first_step", "train"], r
    assert lora["trainable_params"] == peft["trainable_params"] < full["trainable_params"] == full["params"]
    assert lora["model_state_bytes"] < full["model_state_bytes"], (lora, full)
    assert lora["comm_bytes"] > 0 and full["comm_bytes"] > 0 and peft["comm_bytes"] is None
    assert lora["first_loss"] == pytest.approx(peft["first_loss"], rel=1e-2)  # the same model, bf16 apart
    for name in ("vs_full", "vs_torch_peft"):
        assert set(lora[name]) == {"rss", "train_rss", "state", "speed"} and lora[name]["speed"] > 0, lora
    assert "vs_deepspeed_peft" not in lora, lora
    ds = by["deepspeed-peft"]
    assert ds["step_time_s"] is None and ds["status"].startswith("not available"), ds
