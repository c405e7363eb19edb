"""Tier 3: the main job end to end on 4 processes (pp x tp with ZeRO-1), a few steps.

The consolidated model is checked by value: loaded into the serial GPT, it must give the
validation loss the parallel engine logged at the last step (rel 1e-5: the same fp32
forward, with the vocabulary and heads split over tp and the sequence of blocks over pp, sums
in another order). A consolidation that put a shard in the wrong place or the wrong order
would change that loss by far more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tessera.launcher.data import CharTokenizer, TextData, load_corpus
from tessera.models import GPT, GPTConfig

pytestmark = pytest.mark.slow


def test_main_job_writes_a_complete_run_folder(tmp_path: Path) -> None:
    args = [
        "parallel.dp=1",
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.microbatches=2",
        "zero.stage=1",
        "model.d_model=32",
        "model.n_layers=2",
        "model.seq_len=16",
        "data.batch_size=4",
        "data.max_chars=50000",
        "train.steps=6",
        "train.log_every=2",
        "train.eval_every=3",
        "train.name=t",
        "train.sample_chars=40",
        "optim.warmup_steps=2",
    ]
    cmd = [sys.executable, "-m", "tessera.launcher.cli", "train"]
    for a in args:
        cmd += ["--set", a]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "t"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert all(r["tokens_per_s"] > 0 for r in records if "loss" in r)
    reference = [r for r in records if "serial_tokens_per_s" in r]
    assert len(reference) == 1 and reference[0]["serial_tokens_per_s"] > 0 and reference[0]["threads"] >= 1
    assert "the single-process run" in proc.stdout + proc.stderr  # the ratio is logged at the end
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
    latest = (run / "checkpoint" / "latest").read_text().strip()
    assert latest == "step-00000006"
    assert json.loads((run / "checkpoint" / latest / "manifest.json").read_text())["step"] == 6
    state = safetensors.torch.load_file(str(run / "model.safetensors"))
    vocab = CharTokenizer.from_json((run / "tokenizer.json").read_text()).vocab_size
    padded = -(-vocab // 2) * 2  # the main job pads the vocabulary to split over tp=2
    serial = GPT(GPTConfig(padded, 16, 32, 4, 2, 4, 0.0, True), seed=123)
    serial.load_state_dict(state)  # strict: every serial name, full shapes
    data = TextData(load_corpus("stdlib", 50000), val_fraction=0.05, seq_len=16, seed=0)
    with torch.no_grad():
        val = [float(serial.loss(*data.batch("val", 6 * 1000 + i, 4))) for i in range(4)]
    logged = next(r["val_loss"] for r in records if r.get("step") == 6 and "val_loss" in r)
    assert sum(val) / len(val) == pytest.approx(logged, rel=1e-5)
    text = (run / "sample.txt").read_text()
    assert text.startswith("\ndef ") and len(text) == 45
    assert str(run.relative_to(tmp_path)) in proc.stdout + proc.stderr  # says where things are
