"""Tier 3: the main job end to end on 4 processes (pp x tp with ZeRO-1), a few steps.

The consolidated model is checked by value: loaded into the serial GPT, it must give the
validation loss the parallel engine logged at the last step (rel 1e-5: the same fp32
forward, with the vocabulary and heads split over tp and the sequence of blocks over pp, sums
in another order). A consolidation that put a shard in the wrong place or the wrong order
would change that loss by far more.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tessera.launcher import Config, ParallelConfig, TrainConfig
from tessera.launcher.checkpoint import saved_vocab
from tessera.launcher.checkpoint.generations import FORMAT, MANIFEST
from tessera.launcher.data.chars import CharTokenizer, TextData, load_corpus
from tessera.launcher.run.preflight import preflight
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
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train"]
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


def _train(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    base = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4",
            "data.max_chars=50000", "train.log_every=2", "train.eval_every=100", "train.sample_chars=10",
            "optim.warmup_steps=1"]  # fmt: skip
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train"]
    for a in [*base, *sets]:
        cmd += ["--set", a]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def test_the_main_job_resumes_under_another_layout_with_the_saved_vocabulary(tmp_path: Path) -> None:
    """Saved at tp2 (the characters padded to an even vocabulary), resumed at pp2 x dp1 and at
    one process: the vocabulary comes from the checkpoint, not padded again for the new tp,
    so the state reshards and the run goes on. Saved at tp1 with an odd vocabulary, a resume
    at tp2 is refused before anything starts, naming the numbers."""
    first = _train(tmp_path, "parallel.dp=1", "parallel.tp=2", "train.steps=4", "train.checkpoint_every=2",
                   "train.name=a")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads((tmp_path / "runs/a/checkpoint/step-00000004/manifest.json").read_text())
    vocab = saved["config"]["model"]["vocab_size"]
    assert vocab % 2 == 0 and vocab > 0, vocab
    for name, layout in (("b", ["parallel.pp=2", "parallel.microbatches=2"]), ("c", [])):
        again = _train(tmp_path, "parallel.dp=1", *layout, "train.steps=6", f"train.name={name}",
                       "train.resume=runs/a/checkpoint")  # fmt: skip
        assert again.returncode == 0, again.stderr[-3000:]
        records = [json.loads(x) for x in (tmp_path / f"runs/{name}/metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [6], records
    assert vocab == saved_vocab(tmp_path / "runs/a/checkpoint")
    # a checkpoint from before the vocabulary was recorded (0) still resumes under its own layout
    older = tmp_path / "runs/a/checkpoint/step-00000004/manifest.json"
    model = {**saved["config"]["model"], "vocab_size": 0}
    older.write_text(json.dumps({**saved, "config": {**saved["config"], "model": model}}))
    again = _train(tmp_path, "parallel.dp=1", "parallel.tp=2", "train.steps=6", "train.name=f",
                   "train.resume=runs/a/checkpoint")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_resume_whose_vocabulary_does_not_split_over_tp_is_refused_before_spawning(tmp_path: Path) -> None:
    generation = tmp_path / "ckpt" / "step-00000002"
    generation.mkdir(parents=True)
    manifest = {"format": FORMAT, "step": 2, "config": {"model": {"vocab_size": 95}}}
    (generation / MANIFEST).write_text(json.dumps(manifest))
    config = Config(parallel=ParallelConfig(tp=2), train=TrainConfig(resume=str(tmp_path / "ckpt")))
    assert saved_vocab(tmp_path / "ckpt") == 95
    line = (
        f"train.resume={str(tmp_path / 'ckpt')!r}: its vocabulary of 95 does not split over parallel.tp=2; "
        "resume under a tp that divides it, or start runs with --set model.vocab_size=N, a multiple of "
        "every tp to resume under"
    )
    assert line in preflight(config, main_job=True)
    assert line not in preflight(dataclasses.replace(config, parallel=ParallelConfig(dp=2)), main_job=True)
