"""Tier 3: ``tessera train --config configs/moe.toml`` for a few steps: the main job trains its
mixture-of-experts GPT on 2 processes with expert parallelism (ep=2), logs each expert's share
of the routed tokens and the dropped fraction at every logged step, plots them, and its loss
falls; the same run with the experts replicated (ep=1) logs the same losses and loads (rel
1e-6: the same fp32 sums but for the expert gradients' reduction order, summed by the
backward all-to-all at ep=2 and by the all-reduce at ep=1); both consolidate the model, and
the ep=2 checkpoint resumes at ep=1 (its portable state: every expert whole)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moe.toml"


def _train(tmp_path: Path, name: str, *extra: str) -> list[dict[str, Any]]:
    sets = [
        "train.steps=24",
        "train.log_every=4",
        "train.eval_every=24",
        f"train.name={name}",
        "train.sample_chars=10",
        "data.max_chars=100000",
        "optim.warmup_steps=4",
        *extra,
    ]
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train", "--config", str(CONFIG)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = tmp_path / "runs" / name
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_moe_config_trains_and_logs_the_expert_load(tmp_path: Path) -> None:
    records = _train(tmp_path, "ep2")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [4, 8, 12, 16, 20, 24]
    for r in train:
        assert len(r["expert_share"]) == 4 and sum(r["expert_share"]) == pytest.approx(1.0, abs=1e-9)
        assert len(r["expert_share_by_layer"]) == 2  # configs/moe.toml: 2 layers
        assert 0.0 <= r["dropped_fraction"] < 1.0  # capacity 1.25: some may drop, never all
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert (tmp_path / "runs" / "ep2" / "sample.txt").is_file()  # the consolidated model wrote it
    replicated = [r for r in _train(tmp_path, "ep1", "parallel.ep=1") if "loss" in r]
    assert [r["loss"] for r in replicated] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    for a, b in zip(replicated, train, strict=True):
        assert a["expert_share"] == pytest.approx(b["expert_share"], rel=1e-6)
    state = safetensors.torch.load_file(str(tmp_path / "runs" / "ep1" / "model.safetensors"))
    assert state["layers.0.mlp.experts.w1"].shape == (4, 64, 128)  # every expert, whole
    gathered = safetensors.torch.load_file(str(tmp_path / "runs" / "ep2" / "model.safetensors"))
    assert {k: v.shape for k, v in gathered.items()} == {k: v.shape for k, v in state.items()}
    resume = ["parallel.ep=1", "train.steps=28", f"train.resume={tmp_path / 'runs' / 'ep2' / 'checkpoint'}"]
    back = [r for r in _train(tmp_path, "back", *resume) if "loss" in r]
    assert [r["step"] for r in back] == [28] and abs(back[0]["loss"] - train[-1]["loss"]) < 0.5, back
