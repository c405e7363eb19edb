"""Tier 3: ``tessera train --config configs/moe.toml`` for a few steps: the main job trains its
mixture-of-experts GPT on 2 processes, logs each expert's share of the routed tokens and the
dropped fraction at every logged step, plots them, and its loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moe.toml"


def test_the_moe_config_trains_and_logs_the_expert_load(tmp_path: Path) -> None:
    sets = [
        "train.steps=24",
        "train.log_every=4",
        "train.eval_every=24",
        "train.name=moe",
        "train.sample_chars=10",
        "data.max_chars=100000",
        "optim.warmup_steps=4",
    ]
    cmd = [sys.executable, "-m", "tessera.launcher.cli", "train", "--config", str(CONFIG)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = tmp_path / "runs" / "moe"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [4, 8, 12, 16, 20, 24]
    for r in train:
        assert len(r["expert_share"]) == 4 and sum(r["expert_share"]) == pytest.approx(1.0, abs=1e-9)
        assert len(r["expert_share_by_layer"]) == 2  # configs/moe.toml: 2 layers
        assert 0.0 <= r["dropped_fraction"] < 1.0  # capacity 1.25: some may drop, never all
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
    state = safetensors.torch.load_file(str(run / "model.safetensors"))
    assert state["layers.0.mlp.experts.w1"].shape == (4, 64, 128)  # every expert, whole
