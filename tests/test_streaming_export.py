"""Tier 2 (the worker pool): an export streams the model out in shards, never whole on a rank.

``Engine.export(folder, max_shard_bytes=...)`` writes the fp32 masters as they stream past one
ZeRO flat buffer at a time (each tensor gathered over tp), cut into shards of at most that
many bytes, shard ``j`` of a pipeline rank written by the ``j``-th rank of its group in turn,
then the index. Checked at dp2 under ZeRO-3 with the chunk manager's model state on disk, at
dp2 x tp2 under ZeRO-1 and at pp2 x dp2: many shards, written by more than one rank (each
shard's header names the rank that wrote it), the index listing every parameter once
with the shards' total size, and every tensor equal to ``full_state_dict`` exactly (fp32: the
masters are the parameters; a copy, not a sum). A shard limit below one tensor gives that
tensor a shard of its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.comm.safefile import SafeFile
from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.checkpoint.tensorfile import LazyTensors, weight_files
from tessera.models import GPT, GPTConfig, make_batch

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
LIMIT = 3000  # bytes: the 2-layer GPT's 34 KB of fp32 parameters in a dozen shards or more


def _export(rank: int, config: Config, out: str) -> dict[str, torch.Tensor]:
    model = GPT(GPT_CFG, seed=3)
    with boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config) as engine:
        for step in range(2):
            engine.train_step(*make_batch(GPT_CFG, 8, seed=step))
        whole = engine.full_state_dict()
        engine.export(out, max_shard_bytes=LIMIT)
    return whole


CASES = [
    (
        ParallelConfig(dp=2),
        ZeroConfig(stage=3, host_budget_mb=0.05, fractions=(0.0, 0.5, 0.5), chunk_numel=256),
    ),
    (ParallelConfig(dp=2, tp=2), ZeroConfig(stage=1)),
    (ParallelConfig(dp=2, pp=2, microbatches=2), ZeroConfig(stage=2)),
]


def _export_bf16(rank: int, config: Config, out: str) -> dict[str, torch.Tensor]:
    model = GPT(GPT_CFG, seed=3)
    with boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config) as engine:
        engine.train_step(*make_batch(GPT_CFG, 8, seed=0))
        whole = engine.full_state_dict()
        with pytest.raises(ValueError, match="floating type"):
            engine.export(out, dtype=torch.int32)
        engine.export(out, max_shard_bytes=LIMIT, dtype=torch.bfloat16)
    return whole


def test_an_export_in_bfloat16_holds_the_masters_rounded(worker_pools: PoolFactory, tmp_path: Path) -> None:
    """``export(dtype=torch.bfloat16)``: every tensor is the fp32 master rounded to bfloat16
    (exactly ``.to(torch.bfloat16)``: one rounding, no arithmetic), the index's total size
    half the fp32 one; a non-floating dtype is refused before anything is written."""
    config = Config(
        parallel=ParallelConfig(dp=2, tp=2), zero=ZeroConfig(stage=1), train=TrainConfig(precision="fp32")
    )
    out = tmp_path / "export"
    runs: list[Any] = worker_pools(config.world_size).run(_export_bf16, config, str(out), timeout=240)
    whole = {k: v for part in runs for k, v in part.items()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(2 * v.numel() for v in whole.values())
    with LazyTensors(weight_files(out)) as saved:
        assert sorted(saved) == sorted(whole)
        for name, value in whole.items():
            assert saved[name].dtype == torch.bfloat16, name
            assert torch.equal(saved[name], value.to(torch.bfloat16)), f"{name} is not its master rounded"


@pytest.mark.parametrize(("parallel", "zero"), CASES, ids=["dp2-z3-disk", "dp2tp2-z1", "dp2pp2-z2"])
def test_an_export_streams_in_shards_written_by_several_ranks(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig, zero: ZeroConfig
) -> None:
    if zero.chunked:
        zero = dataclasses.replace(zero, disk_dir=str(tmp_path / "disk"))
    config = Config(parallel=parallel, zero=zero, train=TrainConfig(precision="fp32"))
    out = tmp_path / "export"
    runs: list[Any] = worker_pools(config.world_size).run(_export, config, str(out), timeout=240)
    whole: dict[str, torch.Tensor] = {}
    for part in runs:  # each rank: its pipeline stages' tensors
        whole.update(part)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 10 and files == sorted(p.name for p in out.glob("model-*.safetensors")), files
    assert sorted(index["weight_map"]) == sorted(whole), sorted(whole)
    sizes = {name: e.nbytes for f in files for name, e in SafeFile(out / f).entries.items()}
    assert index["metadata"]["total_size"] == sum(sizes[n] for n in whole)
    assert all(sum(e.nbytes for e in SafeFile(out / f).entries.values()) <= LIMIT or
               len(SafeFile(out / f).entries) == 1 for f in files)  # fmt: skip
    with LazyTensors(weight_files(out)) as saved:
        for name, value in whole.items():
            assert torch.equal(saved[name], value), f"{name} differs from full_state_dict"
    writers = {int(SafeFile(out / f).metadata["tessera.rank"]) for f in files}
    assert writers <= set(range(config.world_size)) and len(writers) > 1, writers
