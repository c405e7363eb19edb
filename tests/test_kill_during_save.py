"""Tier 3: a rank SIGKILLed in the middle of a checkpoint save, at several points, loses
nothing: the launcher restarts every rank (``train.max_restarts=1``), they resume from the
newest committed generation (the torn one is passed over) and the loss curve is bit-identical
to an uninterrupted run's.

The kill points, each in the save of step 3 (generation ``step-00000003``): rank 1 writing its
ZeRO shard, rank 1 writing its rank file, rank 1 writing its share of the checksums, and
rank 0 writing the manifest (the commit point itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

def _script(tmp: Path) -> Path:
    path = tmp / "job.py"
    path.write_text(
        """
import json, os, signal, sys
import torch, torch.distributed as dist
import tessera.launcher.checkpoint.saving as saving
import tessera.zero.checkpoint as zckpt
from tessera.models import GPT, GPTConfig, make_batch
from tessera.launcher import boost, load_config
from tessera.launcher.checkpoint import committed_checkpoint

point, out, root = sys.argv[1], sys.argv[2], sys.argv[3]
config = load_config()
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TESSERA_RESTART_COUNT", "0"))
cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
model = GPT(cfg, seed=1)
engine = boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
if committed_checkpoint(root) is not None:
    engine.load(root)
if rank == 0:
    with open(out, "a") as f:
        f.write(json.dumps({"attempt": attempt, "resumed": engine.step}) + "\\n")
victim = 0 if point == "manifest" else 1
names = {"zero": "rank-", "rank-file": "rank-", "hash": ".sha-", "manifest": "manifest.json"}

def dying(original):
    def write(path, *args):
        hit = os.path.basename(str(path)).startswith(names.get(point, "?"))
        if attempt == 0 and engine.step == 3 and rank == victim and hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, *args)
    return write

if point == "zero":
    zckpt.atomic_write = dying(zckpt.atomic_write)
elif point == "rank-file":
    saving.write_tensors = dying(saving.write_tensors)
elif point != "none":
    saving.atomic_write = dying(saving.atomic_write)
for step in range(engine.step, 5):
    loss = engine.train_step(*make_batch(cfg, 4, seed=step)).loss
    engine.save(root)
    if rank == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"step": engine.step, "loss": loss}) + "\\n")
engine.mesh.close()
dist.destroy_process_group()
"""
    )
    return path


def _run(tmp: Path, point: str) -> list[dict[str, float]]:
    out, root = tmp / f"{point}.jsonl", tmp / f"ckpt-{point}"
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "run", "--nproc-per-node", "2"]
    sets = [
        "parallel.dp=2",
        "parallel.microbatches=1",
        "zero.stage=1",
        "data.batch_size=4",
        "model.seq_len=8",
        "model.d_model=16",
        "model.n_layers=2",
        "train.max_restarts=1",
        f"train.run_dir={tmp / 'runs'}",
    ]
    for item in sets:
        cmd += ["--set", item]
    cmd += [str(_script(tmp)), point, str(out), str(root)]
    log = tmp / f"{point}.log"
    with log.open("w") as f:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, cwd=tmp, stdout=f, stderr=subprocess.STDOUT, timeout=240, env=env)
    assert proc.returncode == 0, log.read_text()
    return [json.loads(line) for line in out.read_text().splitlines()]


def _curve(records: list[dict[str, float]]) -> dict[int, float]:
    """The loss of every step, the last attempt's where a step ran twice."""
    return {int(r["step"]): r["loss"] for r in records if "step" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run's curve."""
    return _curve(_run(tmp_path_factory.mktemp("straight"), "none"))


@pytest.mark.parametrize("point", ["zero", "rank-file", "hash", "manifest"])
def test_a_kill_during_a_save_loses_nothing(tmp_path: Path, point: str, straight: dict[int, float]) -> None:
    records = _run(tmp_path, point)
    starts = [(r["attempt"], r["resumed"]) for r in records if "resumed" in r]
    assert starts == [(0, 0), (1, 2)], records  # step 3's generation was torn: back to step 2
    assert _curve(records) == straight, records
