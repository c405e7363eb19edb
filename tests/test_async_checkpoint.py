"""Background checkpoints (``Engine.save(background=True)``) on real gloo processes.

- A generation saved in the background loads to exactly the state a generation saved at
  once loads to, and to the saver's state: bit-equal tensors (``torch.equal``), since both
  write the same values and loading copies them.
- Training goes on while the writer writes, and what the writer writes is the snapshot:
  the writer is held (the test wraps the library's file writer with a wait) until the
  training thread has run another step; the event order proves it, not timing.
- A failed background write raises on every rank at the next wait, naming the file.
- A rank SIGKILLed in the middle of a background write loses nothing: the launcher restarts
  every rank, they resume from the previous committed generation and the loss curve equals
  an uninterrupted run's (slow; real processes through the launcher, as
  ``test_kill_during_save.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import tessera.launcher.checkpoint.saving as saving
from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, Engine, ParallelConfig, ZeroConfig, boost
from tessera.models import GPT, GPTConfig, make_batch

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)


def _config(parallel: ParallelConfig, zero: ZeroConfig) -> Config:
    c = Config(parallel=parallel, zero=zero)
    return dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=4),
        model=dataclasses.replace(c.model, seq_len=8, d_model=16, n_heads=4, n_layers=2),
    )


def _engine(config: Config) -> Engine:
    model = GPT(GPT_CFG, seed=1)
    return boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _state(engine: Engine, where: Path) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the engine now, read back from a generation saved at once
    under ``where`` (collective): every rank's module, RNG, master shards and optimizer state
    (the portable state, another view of the same, is left out)."""
    generation = engine.save(where)
    out = {}
    for file in sorted(generation.rglob("*.safetensors")):
        rel = str(file.relative_to(generation))
        if not rel.startswith("portable/"):
            out.update({f"{rel}:{k}": v for k, v in safetensors.torch.load_file(file).items()})
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _save_both_ways(rank: int, root: str, config: Config) -> dict[str, list[str]]:
    saver = _engine(config)
    for step in range(2):
        saver.train_step(*make_batch(GPT_CFG, 4, seed=step))
    saved = _state(saver, Path(root) / "now")
    at_once = saver.save(Path(root) / "at-once")
    behind = saver.save(Path(root) / "background", background=True)
    assert saver.wait_for_save() == behind
    saver.close()
    out = {}
    for name, generation in (("at-once", at_once), ("background", behind)):
        fresh = _engine(config)
        fresh.load(generation)
        out[name] = _differing(saved, _state(fresh, Path(root) / f"{name}-loaded"))
        fresh.close()
    return out


CONFIGS = {
    "dp2-zero1": (ParallelConfig(dp=2, microbatches=1), ZeroConfig(stage=1)),
    "dp2-zero3": (ParallelConfig(dp=2, microbatches=1), ZeroConfig(stage=3)),
    "tp2-zero0": (ParallelConfig(tp=2, microbatches=1), ZeroConfig(stage=0)),
    "dp2-chunks-disk": (
        ParallelConfig(dp=2, microbatches=1),
        ZeroConfig(stage=1, fractions=(0.0, 0.5, 0.5), chunk_numel=256),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_background_save_loads_to_the_same_state(
    worker_pools: PoolFactory, tmp_path: Path, name: str
) -> None:
    parallel, zero = CONFIGS[name]
    if zero.fractions:
        zero = dataclasses.replace(zero, disk_dir=str(tmp_path / "disk"))
    config = _config(parallel, zero)
    outcomes = worker_pools(2).run(_save_both_ways, str(tmp_path / "ckpt"), config, timeout=240)
    # exact: both generations hold copies of the same tensors and loading copies them back
    assert outcomes == [{"at-once": [], "background": []}] * 2, outcomes


def _slow_meta(rank: int, root: str, config: Config) -> list[str]:
    """A background save under tp=2 (each tp rank its own ZeRO group, writing its own
    meta.json) whose rank 1 writes its meta.json a second late."""
    import time

    from tessera.zero.checkpoint import ShardSave

    original = ShardSave.commit

    def late(self: ShardSave, error: BaseException | None = None) -> None:
        if rank == 1:
            time.sleep(1.0)
        original(self, error)

    engine = _engine(config)
    engine.train_step(*make_batch(GPT_CFG, 4, seed=0))
    ShardSave.commit = late  # type: ignore[method-assign]
    try:
        generation = engine.save(Path(root), background=True)
        assert engine.wait_for_save() == generation
    finally:
        ShardSave.commit = original  # type: ignore[method-assign]
    engine.close()
    return sorted(str(p.relative_to(generation)) for p in generation.rglob("meta.json"))


def test_a_late_group_meta_json_is_waited_for(worker_pools: PoolFactory, tmp_path: Path) -> None:
    """The commit reads the checksums only once every ZeRO group has written its meta.json
    (a group is one tp rank here, so its own commit waits for no other rank)."""
    parallel, zero = CONFIGS["tp2-zero0"]
    got = worker_pools(2).run(_slow_meta, str(tmp_path / "ckpt"), _config(parallel, zero), timeout=120)
    assert got[0] == got[1] and len(got[0]) == 2, got


def _held_writer(rank: int, root: str, views: str) -> dict[str, Any]:
    """Save in the background with the writer held until the training thread has stepped."""
    config = _config(ParallelConfig(dp=2, microbatches=1), ZeroConfig(stage=1))
    engine = _engine(config)
    engine.train_step(*make_batch(GPT_CFG, 4, seed=0))
    snapshot = _state(engine, Path(views) / "snapshot")
    events: list[str] = []
    stepped = threading.Event()
    original = saving.write_tensors

    def held(*args: Any) -> bytes:
        if threading.current_thread() is not threading.main_thread() and not stepped.is_set():
            events.append("writer waits")
            assert stepped.wait(timeout=60), "the training thread never stepped"
            events.append("writer writes")
        return original(*args)

    saving.write_tensors = held
    try:
        generation = engine.save(root, background=True)
        events.append("save returned")
        engine.train_step(*make_batch(GPT_CFG, 4, seed=1))
        events.append("stepped")
        stepped.set()
        engine.wait_for_save()
    finally:
        saving.write_tensors = original
    after = _state(engine, Path(views) / "after")  # the state the later step left
    engine.close()
    fresh = _engine(config)
    fresh.load(root)
    loaded = _state(fresh, Path(views) / "loaded")
    fresh.close()
    return {
        "events": [e for e in events if e != "writer waits"],
        "waited": "writer waits" in events,
        "generation": generation.name,
        "step": fresh.step,
        "vs_snapshot": _differing(snapshot, loaded),
        "vs_later": len(_differing(after, loaded)),
    }


def test_training_goes_on_while_the_writer_writes_the_snapshot(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    outcomes = worker_pools(2).run(_held_writer, str(tmp_path / "ckpt"), str(tmp_path / "views"), timeout=240)
    for out in outcomes:
        # the rank file is the writer's first file: nothing was written before the step
        assert out["waited"] and out["events"] == ["save returned", "stepped", "writer writes"], out
        assert out["generation"] == "step-00000001" and out["step"] == 1, out
        assert out["vs_snapshot"] == [], out  # exactly the snapshot's state ...
        assert out["vs_later"] > 0, out  # ... which the later step changed


def _failing_writer(rank: int, root: str) -> str:
    config = _config(ParallelConfig(dp=2, microbatches=1), ZeroConfig(stage=1))
    engine = _engine(config)
    engine.train_step(*make_batch(GPT_CFG, 4, seed=0))
    engine.save(root)  # step 1, committed
    engine.train_step(*make_batch(GPT_CFG, 4, seed=1))
    go = threading.Event()
    original = saving.write_tensors

    def held(*args: Any) -> bytes:
        if threading.current_thread() is not threading.main_thread():
            assert go.wait(timeout=60)
        return original(*args)

    saving.write_tensors = held
    try:
        engine.save(root, background=True)
        if rank == 1:  # a directory where rank 1's file goes: its rename fails
            (Path(root) / "step-00000002" / "rank-00001.safetensors").mkdir(parents=True)
        go.set()
        try:
            engine.wait_for_save()
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        else:
            outcome = "committed"
    finally:
        saving.write_tensors = original
    engine.close()  # nothing is pending any more: closing does not raise again
    fresh = _engine(config)
    fresh.load(root)
    outcome += f" | loaded step {fresh.step}"
    fresh.close()
    return outcome


def test_a_failed_background_write_raises_on_every_rank_naming_the_file(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    outcomes = worker_pools(2).run(_failing_writer, str(tmp_path / "ckpt"), timeout=240)
    for outcome in outcomes:
        assert "step-00000002/rank-00001.safetensors" in outcome, outcomes
        assert outcome.endswith("| loaded step 1"), outcomes  # the torn one is passed over
    assert outcomes[1].startswith("OSError: writing"), outcomes
    assert outcomes[0].startswith("RemoteFailure"), outcomes


# ---------------------------------------------------------------------------- a kill, for real
_JOB = """
import json, os, signal, sys, threading
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
def dying(original, prefix):
    def write(path, *args):
        writer = threading.current_thread() is not threading.main_thread()
        name = os.path.basename(str(path))
        saving_3 = "step-00000003" in str(path)  # the path, not a step the training thread moves on
        if attempt == 0 and saving_3 and rank == 1 and writer and name.startswith(prefix):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, *args)
    return write

if point == "zero":
    zckpt.write_tensors = dying(zckpt.write_tensors, "rank-")
elif point == "rank-file":
    saving.write_tensors = dying(saving.write_tensors, "rank-")
for step in range(engine.step, 5):
    loss = engine.train_step(*make_batch(cfg, 4, seed=step)).loss
    engine.save(root, background=True)
    if rank == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"step": engine.step, "loss": loss}) + "\\n")
engine.close()
dist.destroy_process_group()
"""


def _launch(tmp: Path, point: str) -> list[dict[str, float]]:
    out, root = tmp / f"{point}.jsonl", tmp / f"ckpt-{point}"
    script = tmp / "job.py"
    script.write_text(_JOB)
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
    cmd += [str(script), point, str(out), str(root)]
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
    """The uninterrupted run's curve (every save in the background)."""
    records = _launch(tmp_path_factory.mktemp("straight"), "none")
    assert [r["resumed"] for r in records if "resumed" in r] == [0], records
    return _curve(records)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["rank-file", "zero"])
def test_a_kill_during_a_background_write_loses_nothing(
    tmp_path: Path, point: str, straight: dict[int, float]
) -> None:
    records = _launch(tmp_path, point)
    starts = [(r["attempt"], r["resumed"]) for r in records if "resumed" in r]
    # step 3's generation was being written: step 2's was committed when step 3's save began
    assert starts == [(0, 0), (1, 2)], records
    assert _curve(records) == straight, records
    generations = sorted(p.name for p in (tmp_path / f"ckpt-{point}").glob("step-*"))
    assert generations == ["step-00000004", "step-00000005"], generations  # keep_last=2
