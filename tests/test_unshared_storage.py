"""Checkpoints without shared storage: each node its own checkpoint folder (gloo processes).

A "node" here is a set of ranks given their own folder (``node-K/ckpt`` for rank // ranks per
node): what ranks on machines with their own disks see of one path. The engine finds out by
itself that the folder is not shared (``tessera.launcher.checkpoint.storage``), keeps every file in two
nodes' folders, and a load first makes the generation whole in every folder. The losses after
a resume must equal the uninterrupted run's bit for bit: same ranks, same layout, the same
values loaded (``==`` on the floats).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, Engine, ParallelConfig, ZeroConfig, boost
from tessera.launcher.checkpoint.storage import probe_storage
from tessera.models import GPT, GPTConfig, make_batch

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)


def _engine(parallel: ParallelConfig, stage: int) -> Engine:
    c = Config(parallel=parallel, zero=ZeroConfig(stage=stage))
    config = dataclasses.replace(c, data=dataclasses.replace(c.data, batch_size=12))
    model = GPT(GPT_CFG, seed=1)
    return boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _folder(base: str, rank: int, per_node: int) -> Path:
    return Path(base) / f"node-{rank // per_node}" / "ckpt"


def _steps(engine: Engine, seeds: range) -> list[float]:
    return [engine.train_step(*make_batch(GPT_CFG, 12, seed=s)).loss for s in seeds]


def _train_and_save(rank: int, base: str, per_node: int, parallel: ParallelConfig, stage: int) -> list[float]:
    with _engine(parallel, stage) as engine:
        _steps(engine, range(2))
        engine.save(_folder(base, rank, per_node))
        return _steps(engine, range(2, 4))


def _resume(rank: int, base: str, per_node: int, parallel: ParallelConfig, stage: int) -> list[float]:
    with _engine(parallel, stage) as engine:
        engine.load(_folder(base, rank, per_node))
        assert engine.step == 2
        return _steps(engine, range(2, 4))


def _domains(rank: int, base: str, per_node: int) -> list[list[int]]:
    return [list(d) for d in probe_storage(_folder(base, rank, per_node)).domains]


def test_the_probe_finds_who_shares_a_folder(worker_pools: PoolFactory, tmp_path: Path) -> None:
    assert worker_pools(4).run(_domains, str(tmp_path), 2) == [[[0, 1], [2, 3]]] * 4
    assert worker_pools(4).run(_domains, str(tmp_path), 4) == [[[0, 1, 2, 3]]] * 4
    assert worker_pools(4).run(_domains, str(tmp_path), 1) == [[[0], [1], [2], [3]]] * 4
    assert not list(tmp_path.rglob("*-0000*")), "the probe's tokens stay behind"


@pytest.mark.parametrize(
    ("parallel", "stage"),
    [(ParallelConfig(dp=4, microbatches=1), 1), (ParallelConfig(dp=2, tp=2, microbatches=1), 3)],
    ids=["dp4-zero1", "dp2xtp2-zero3"],
)
def test_two_nodes_with_their_own_disks_resume_exactly(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig, stage: int
) -> None:
    pool = worker_pools(4)
    straight = pool.run(_train_and_save, str(tmp_path), 2, parallel, stage)
    gens = [tmp_path / f"node-{k}" / "ckpt" / "step-00000002" for k in (0, 1)]
    manifests = [json.loads((g / "manifest.json").read_text()) for g in gens]
    assert manifests[0] == manifests[1], "the nodes' manifests differ"
    holders = manifests[0]["storage"]["holders"]
    assert set(holders) == set(manifests[0]["files"]) and all(sorted(h) == [0, 1] for h in holders.values())
    for gen in gens:  # two nodes: each folder holds every file
        assert all((gen / rel).is_file() for rel in manifests[0]["files"]), gen
    assert pool.run(_resume, str(tmp_path), 2, parallel, stage) == straight
    shutil.rmtree(tmp_path / "node-1")  # node 1 lost its disk: its files come back from node 0
    assert pool.run(_resume, str(tmp_path), 2, parallel, stage) == straight
    assert all((gens[1] / rel).is_file() for rel in manifests[0]["files"])


def test_three_nodes_keep_each_file_twice_and_survive_one_lost_disk(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    pool, parallel = worker_pools(3), ParallelConfig(dp=3, microbatches=1)
    straight = pool.run(_train_and_save, str(tmp_path), 1, parallel, 2)
    gen = Path("ckpt") / "step-00000002"
    manifest = json.loads((tmp_path / "node-0" / gen / "manifest.json").read_text())
    holders = manifest["storage"]["holders"]
    assert all(len(h) == 2 for h in holders.values()), holders
    own = f"rank-{1:05d}.safetensors"
    assert sorted(holders[own]) == [1, 2], holders[own]  # a file goes to the next node
    assert not (tmp_path / "node-0" / gen / own).exists()
    two_lost = tmp_path / "two-lost"  # only node 0's disk is left: rank 1's file is nowhere
    shutil.copytree(tmp_path / "node-0", two_lost / "node-0")
    errors = pool.run(_load_error, str(two_lost), parallel)
    assert all(
        "holds no committed generation whose files the nodes have between them" in e for e in errors
    ), errors
    shutil.rmtree(tmp_path / "node-1")  # one disk lost: every file is still on another node
    assert pool.run(_resume, str(tmp_path), 1, parallel, 2) == straight


def _load_error(rank: int, base: str, parallel: ParallelConfig) -> str:
    with _engine(parallel, 2) as engine:
        try:
            engine.load(_folder(base, rank, 1))
        except (ValueError, RuntimeError) as exc:
            return str(exc)
    return "loaded"


def _save_over_torn(rank: int, base: str, per_node: int) -> list[str]:
    folder = _folder(base, rank, per_node)
    with _engine(ParallelConfig(dp=4, microbatches=1), 1) as engine:
        _steps(engine, range(2))
        torn = folder / "step-00000002"  # what a save of step 2 under another layout left behind
        (torn / "zero" / "pp-0-tp-0").mkdir(parents=True, exist_ok=True)
        (torn / "zero" / "pp-0-tp-0" / "rank-00007-of-00008.safetensors").write_bytes(b"torn")
        (torn / "rank-00007.safetensors").write_bytes(b"torn")
        return sorted(json.loads((engine.save(folder) / "manifest.json").read_text())["files"])


@pytest.mark.parametrize("per_node", [4, 2], ids=["shared", "two-folders"])
def test_a_save_replaces_a_torn_generation_of_another_layout(
    worker_pools: PoolFactory, tmp_path: Path, per_node: int
) -> None:
    """A job restarted on fewer ranks saves a step whose save was torn by the loss: the files
    of the old layout go, and the generation commits (this raised "the ranks hashed 4 files,
    the generation holds 5")."""
    files = worker_pools(4).run(_save_over_torn, str(tmp_path), per_node)
    assert all(f == files[0] for f in files) and not any("00007" in f for f in files[0]), files
