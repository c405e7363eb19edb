"""Integration: the chunk memory manager through the config and ``boost()``.

``zero.host_budget_mb`` / ``zero.disk_dir`` / ``zero.policy`` / ``zero.fractions`` /
``zero.chunk_numel`` turn on ``tessera.zero.chunks`` for every rank of a composition. Each
chunked run is compared with the same composition without chunks, step by step: the
chunk manager only moves where the masters, gradient shards and optimizer state live and
steps the optimizer one chunk at a time; both are elementwise, so losses and weights are
required to be *equal* (``torch.equal``), not close. The gradient norm is summed per chunk
instead of per flat buffer (another order), so norms get rel 1e-6; clipping scales by
min(1, clip/norm), which is 1 here (``CLIP`` is large), so the order cannot reach the
weights. A chunk written to the wrong place or read back wrong moves a weight at once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.config.config_io import ConfigError, resolve_config
from tessera.launcher.run.preflight import preflight
from tessera.models import GPT, GPTConfig, make_batch

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
BATCH = 8
STEPS = 4
CLIP = 100.0


def _config(parallel: ParallelConfig, zero: ZeroConfig, clip: float = CLIP) -> Config:
    c = Config(parallel=parallel, zero=zero, train=TrainConfig(precision="fp32"))
    return dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=BATCH),
        model=dataclasses.replace(c.model, seq_len=GPT_CFG.seq_len, d_model=16, n_heads=4, n_layers=2),
        optim=dataclasses.replace(c.optim, name="adamw", lr=1e-2, clip_grad_norm=clip, weight_decay=0.1),
    )


def _engine(config: Config) -> Any:
    model = GPT(GPT_CFG, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return boost(model, opt, config)


def _train(rank: int, config: Config) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    engine = _engine(config)
    out = []
    for step in range(STEPS):
        result = engine.train_step(*make_batch(GPT_CFG, BATCH, seed=step))
        assert result.grad_norm is not None
        out.append((result.loss, result.grad_norm))
    weights = engine.full_state_dict()
    engine.mesh.close()
    return out, weights


def _disk_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


CASES = [
    (ParallelConfig(dp=2), dict(stage=3, host_budget_mb=0.05, fractions=(0.0, 0.5, 0.5), chunk_numel=256)),
    (ParallelConfig(dp=2, tp=2), dict(stage=2, host_budget_mb=0.03, chunk_numel=128)),
    (
        ParallelConfig(dp=2, pp=2, microbatches=2),
        dict(stage=1, host_budget_mb=0.03, policy="auto", chunk_numel=128),
    ),
    (ParallelConfig(dp=2, microbatches=2), dict(stage=0, fractions=(0.0, 0.0, 1.0), chunk_numel=512)),
]


@pytest.mark.parametrize(
    ("parallel", "chunks"), CASES, ids=["dp2-z3-static", "dp2tp2-z2-fill", "dp2pp2-z1-auto", "dp2-z0-disk"]
)
def test_a_chunked_composition_equals_the_unchunked_one(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig, chunks: dict[str, Any]
) -> None:
    disk = tmp_path / "chunks"
    chunked = _config(parallel, ZeroConfig(disk_dir=str(disk), **chunks))
    plain = _config(parallel, ZeroConfig(stage=chunks["stage"]))
    assert chunked.validate() == [] and chunked.zero.chunked and not plain.zero.chunked
    want = worker_pools(plain.world_size).run(_train, plain, timeout=180)
    got = worker_pools(chunked.world_size).run(_train, chunked, timeout=180)
    assert sorted(p.name for p in disk.iterdir()) == [f"rank{r}" for r in range(chunked.world_size)]
    assert _disk_files(disk) > 0  # the disk tier really held chunks
    for (curve, weights), (ref_curve, ref_weights) in zip(got, want, strict=True):
        assert [loss for loss, _ in curve] == [loss for loss, _ in ref_curve]
        assert [n for _, n in curve] == pytest.approx([n for _, n in ref_curve], rel=1e-6)
        assert weights.keys() == ref_weights.keys()
        for name, value in weights.items():
            assert torch.equal(value, ref_weights[name]), name


@pytest.mark.parametrize(
    ("parallel", "chunks"),
    [
        (
            ParallelConfig(dp=2),
            dict(stage=3, host_budget_mb=0.05, fractions=(0.0, 0.25, 0.75), chunk_numel=256),
        ),
        (
            ParallelConfig(dp=2, pp=2, microbatches=2),
            dict(stage=1, fractions=(0.0, 0.0, 1.0), chunk_numel=128),
        ),
    ],
    ids=["dp2-z3", "dp2pp2-z1"],
)
def test_without_clipping_disk_chunks_step_in_backward_as_the_unchunked_run(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig, chunks: dict[str, Any]
) -> None:
    """``zero.step_in_backward`` (the default) with no clipping: from the second step the disk
    chunks step as their gradient arrives (a pipeline's, at the step, where it reduces), with
    the same losses, norms and weights as the run without chunks."""
    chunked = _config(parallel, ZeroConfig(disk_dir=str(tmp_path / "chunks"), **chunks), clip=0.0)
    plain = _config(parallel, ZeroConfig(stage=chunks["stage"]), clip=0.0)
    want = worker_pools(plain.world_size).run(_train, plain, timeout=180)
    got = worker_pools(chunked.world_size).run(_stepped_in_backward, chunked, timeout=180)
    for (curve, weights, early), (ref_curve, ref_weights) in zip(got, want, strict=True):
        assert early, "no chunk stepped in backward"
        assert [loss for loss, _ in curve] == [loss for loss, _ in ref_curve]
        assert [n for _, n in curve] == pytest.approx([n for _, n in ref_curve], rel=1e-6)
        for name, value in weights.items():
            assert torch.equal(value, ref_weights[name]), name


def _stepped_in_backward(
    rank: int, config: Config
) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], bool]:
    """``_train``, and whether some chunk stepped in backward (its disk bytes per step fell)."""
    engine = _engine(config)
    store = engine.zero._chunks
    assert store is not None and store.early is not None and store.disk is not None
    out, written = [], []
    for step in range(STEPS):
        before = store.disk.bytes_written
        result = engine.train_step(*make_batch(GPT_CFG, BATCH, seed=step))
        out.append((result.loss, result.grad_norm))
        written.append(store.disk.bytes_written - before)
    weights = engine.full_state_dict()
    engine.mesh.close()
    return out, weights, written[0] > written[1] == written[2] > 0


def test_the_config_reads_and_checks_the_chunk_settings(tmp_path: Path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text(
        '[zero]\nstage = 3\nhost_budget_mb = 64\ndisk_dir = "/tmp/x"\nfractions = [0, 0.25, 0.75]\n'
    )
    config = resolve_config(toml, env={})
    assert config.zero.fractions == (0.0, 0.25, 0.75) and config.zero.host_budget_mb == 64.0
    assert config.zero.chunked
    config = resolve_config(toml, env={"TESSERA_ZERO_FRACTIONS": "0,0,1", "TESSERA_ZERO_POLICY": "static"})
    assert config.zero.fractions == (0.0, 0.0, 1.0)
    with pytest.raises(ConfigError, match=r"zero\.fractions='0,x' is not a comma-separated list"):
        resolve_config(toml, env={"TESSERA_ZERO_FRACTIONS": "0,x"})
    toml.write_text('[zero]\nfractions = "0,1,0"\n')
    with pytest.raises(ConfigError, match="must be an array of numbers"):
        resolve_config(toml, env={})

    def errors(**zero: Any) -> list[str]:
        return Config(zero=ZeroConfig(**zero)).validate()

    assert errors(host_budget_mb=8.0) == []
    assert errors(host_budget_mb=-1.0) == [
        "zero.host_budget_mb=-1.0 must be >= 0 (0: not limited / not used)"
    ]
    assert errors(host_budget_mb=8.0, offload=True) == [
        "zero.offload=true and the chunk manager (a budget or zero.disk_dir) exclude each other"
    ]
    assert errors(host_budget_mb=8.0, policy="greedy") == ["zero.policy='greedy' is not one of static, auto"]
    assert errors(host_budget_mb=8.0, fractions=(0.5, 0.6, 0.0)) == [
        "zero.fractions=[0.5, 0.6, 0.0] must sum to 1, not 1.1"
    ]
    assert errors(host_budget_mb=8.0, fractions=(0.0, 0.5, 0.5)) == [
        "zero.fractions=[0.0, 0.5, 0.5] puts chunks on disk but zero.disk_dir is empty"
    ]
    assert errors(disk_dir="d", policy="auto", fractions=(0.0, 0.5, 0.5)) == [
        "zero.fractions are for zero.policy='static'; 'auto' places by measured free memory"
    ]
    assert errors(fractions=(1.0, 0.0, 0.0)) == [
        "zero.fractions is set but no budget and no zero.disk_dir: the chunk manager is off"
    ]
    assert errors(disk_dir="d", chunk_numel=-2) == ["zero.chunk_numel must be >= 0, got -2"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = Config(zero=ZeroConfig(disk_dir=str(blocker)), train=TrainConfig(run_dir=str(tmp_path / "runs")))
    assert preflight(config, main_job=False) == [f"zero.disk_dir={str(blocker)!r} is a file, not a directory"]


def _fresh(config: Config) -> Any:
    model = GPT(GPT_CFG, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return boost(model, opt, config)


def _save_at_two(rank: int, config: Config, path: str) -> list[float]:
    engine = _fresh(config)
    losses = []
    for step in range(5):
        losses.append(engine.train_step(*make_batch(GPT_CFG, BATCH, seed=step)).loss)
        if step == 1:
            engine.save(path)
    engine.mesh.close()
    return losses


def _resume_at_two(rank: int, config: Config, path: str) -> list[float]:
    engine = _fresh(config)
    engine.load(path)
    assert engine.step == 2
    losses = [engine.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(2, 5)]
    engine.mesh.close()
    return losses


def test_a_chunked_run_resumes_and_reshards(worker_pools: PoolFactory, tmp_path: Path) -> None:
    """dp2 x ZeRO-3 with half the chunks on disk saves after two steps. Loaded by the same
    layout (its own chunk files), the next three losses are the uninterrupted run's, bit for
    bit; loaded by dp2 x tp2 ZeRO-1 without chunks, and by dp4 ZeRO-2 with other chunks,
    through the portable state (streamed one parameter at a time), within rel 1e-5 (the
    state is carried exactly; the runs then sum in other orders)."""
    path = str(tmp_path / "ckpt")
    chunks = ZeroConfig(stage=3, host_budget_mb=0.05, fractions=(0.0, 0.5, 0.5), chunk_numel=256)
    saver = _config(ParallelConfig(dp=2), dataclasses.replace(chunks, disk_dir=str(tmp_path / "a")))
    straight = worker_pools(2).run(_save_at_two, saver, path, timeout=180)[0]
    again = dataclasses.replace(saver, zero=dataclasses.replace(saver.zero, disk_dir=str(tmp_path / "b")))
    for resumed in worker_pools(2).run(_resume_at_two, again, path, timeout=180):
        assert resumed == straight[2:]
    others = [
        _config(ParallelConfig(dp=2, tp=2), ZeroConfig(stage=1)),
        _config(
            ParallelConfig(dp=4, microbatches=2),
            ZeroConfig(stage=2, disk_dir=str(tmp_path / "c"), chunk_numel=128),
        ),
    ]
    for config in others:
        for resumed in worker_pools(config.world_size).run(_resume_at_two, config, path, timeout=180):
            assert resumed == pytest.approx(straight[2:], rel=1e-5)


def _train_then_close(rank: int, config: Config) -> tuple[int, int, int]:
    import torch.distributed as dist

    def groups() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    before = groups()
    with _engine(config) as engine:
        engine.train_step(*make_batch(GPT_CFG, BATCH, seed=0))
        during = groups()
    return before, during, groups()


def test_closing_an_engine_releases_its_groups_and_its_disk_chunks(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """A long-lived process that boosts model after model must not keep the groups, threads
    and chunk files of the ones it finished with: ``Engine.close`` (or ``with boost(...)``)."""
    config = _config(
        ParallelConfig(dp=2, tp=2), ZeroConfig(stage=2, disk_dir=str(tmp_path / "chunks"), chunk_numel=128)
    )
    for rank, (before, during, after) in enumerate(worker_pools(4).run(_train_then_close, config)):
        assert during > before, f"rank {rank}: boost made no group"
        assert after == before, f"rank {rank}: {after - before} groups outlived Engine.close()"
    disk = tmp_path / "chunks"
    left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file() or "chunks" in p.name)
    assert disk.exists() and left == [], f"chunk files left behind: {left}"
