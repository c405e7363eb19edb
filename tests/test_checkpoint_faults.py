"""Faults: a corrupt or foreign engine checkpoint raises on every rank, none hangs.

Real gloo processes (the worker pool): after a save, one rank's file is damaged; loading
must raise on every rank (the damaged rank its own checksum error, the others a
`RemoteFailure`) before any collective, so the pool's next example still runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, Diverged, Engine, ParallelConfig, ZeroConfig, boost
from tessera.models import GPT, GPTConfig, make_batch

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)


def _engine(config: Config) -> Engine:
    model = GPT(GPT_CFG, seed=1)
    return boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _config(dp: int, tp: int, zero: int) -> Config:
    c = Config(parallel=ParallelConfig(dp=dp, tp=tp, microbatches=1), zero=ZeroConfig(stage=zero))
    return dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=4),
        model=dataclasses.replace(c.model, seq_len=8, d_model=16, n_heads=4, n_layers=2),
    )


def _damage_and_load(rank: int, path: str, damage: str) -> str:
    engine = _engine(_config(dp=2, tp=1, zero=1))
    engine.train_step(*make_batch(GPT_CFG, 4, seed=0))
    engine.save(path)
    if rank == 0:
        file = Path(path) / "step-00000001" / "rank-00001.safetensors"
        if damage == "flip":
            data = bytearray(file.read_bytes())
            data[-1] ^= 0xFF
            file.write_bytes(bytes(data))
        else:
            file.unlink()
    dist.barrier()
    fresh = _engine(_config(dp=2, tp=1, zero=1))
    try:
        fresh.load(path)
    except Exception as e:  # reported to the test, which checks every rank raised
        outcome = f"{type(e).__name__}: {e}"
    else:
        outcome = "loaded"
    # the pool's group still works: no rank is stuck in a collective
    fresh.train_step(*make_batch(GPT_CFG, 4, seed=1))
    engine.mesh.close()
    fresh.mesh.close()
    return outcome


def test_a_damaged_rank_file_raises_on_every_rank(worker_pools: PoolFactory, tmp_path: Path) -> None:
    for damage, own in (("flip", "does not match its checksum"), ("remove", "No such file")):
        path = str(tmp_path / damage)
        outcomes = worker_pools(2).run(_damage_and_load, path, damage, timeout=120)
        # rank 1 finds its own file damaged; rank 0 either hashed that file itself (the ranks
        # split the checksums) or quotes rank 1's error: both name the file and the damage
        for outcome in outcomes:
            assert own in outcome and "rank-00001.safetensors" in outcome, outcomes
        assert own in outcomes[1] and outcomes[1].startswith(("ValueError", "FileNotFoundError")), outcomes


def _load_other_layout(rank: int, path: str, damage: str) -> str:
    saver = _engine(_config(dp=2, tp=2, zero=0))
    saver.save(path)
    saver.mesh.close()
    if rank == 0 and damage == "portable":
        (Path(path) / "step-00000000" / "portable" / "pp-000.safetensors").unlink()
    dist.barrier()
    config = _config(dp=4, tp=1, zero=0)
    if damage == "model":
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=3))
    other = _engine(config)
    try:
        other.load(path)
    except Exception as e:  # every rank reports what it raised
        return f"{type(e).__name__}: {e}"
    finally:
        other.mesh.close()
    return "loaded"


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("none", "loaded"),
        ("model", "saved under another configuration: model.n_layers: saved 2, now 3"),
        ("portable", "portable/pp-000.safetensors"),
    ],
)
def test_a_checkpoint_of_another_topology_reshards_or_is_refused_by_name(
    worker_pools: PoolFactory, tmp_path: Path, damage: str, expected: str
) -> None:
    """Saved by dp2 x tp2, loaded by dp4: resharded (values: tests/test_compose.py), unless the
    model differs or the portable part is missing, which every rank refuses by name."""
    for message in worker_pools(4).run(_load_other_layout, str(tmp_path / "ckpt"), damage, timeout=120):
        assert expected in message, message


def _generations(rank: int, root: str) -> dict[str, object]:
    """Saves at steps 1, 2, 3 (keep_last=2), then edits, tears and reloads."""
    engine = _engine(_config(dp=2, tp=1, zero=1))
    losses = []
    for step in range(3):
        losses.append(engine.train_step(*make_batch(GPT_CFG, 4, seed=step)).loss)
        engine.save(root, keep_last=2)
    kept = sorted(p.name for p in Path(root).glob("step-*"))
    out: dict[str, object] = {"kept": kept, "latest": (Path(root) / "latest").read_text().strip()}

    def load(path: str) -> str:
        fresh = _engine(_config(dp=2, tp=1, zero=1))
        try:
            return str(fresh.load(path).name) + f" step {fresh.step}"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            fresh.mesh.close()

    out["newest"] = load(root)
    newest = Path(root) / "step-00000003"
    manifest = newest / "manifest.json"
    if rank == 0:  # an edited step in the manifest
        manifest.write_text(manifest.read_text().replace('"step": 3', '"step": 100'))
    dist.barrier()
    out["edited"] = load(str(newest))
    if rank == 0:  # a torn save: the newest generation without its manifest
        manifest.unlink()
    dist.barrier()
    out["torn"] = load(root)
    engine.mesh.close()
    return out


def test_generations_commit_prune_and_refuse_edits(worker_pools: PoolFactory, tmp_path: Path) -> None:
    """Each save is a new generation committed by its manifest; keep_last prunes; an edited
    manifest is refused on every rank; a torn newest generation falls back to the one before."""
    for out in worker_pools(2).run(_generations, str(tmp_path / "ckpt"), timeout=180):
        assert out["kept"] == ["step-00000002", "step-00000003"], out
        assert out["latest"] == "step-00000003", out
        assert out["newest"] == "step-00000003 step 3", out
        assert "says step 100 but lies in step-00000003" in str(out["edited"]), out
        assert out["torn"] == "step-00000002 step 2", out


def _diverge(rank: int, stage: int) -> dict[str, object]:
    model = GPT(GPT_CFG, seed=1)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=1e6), _config(dp=2, tp=1, zero=stage))
    engine.max_skipped_steps = 2
    skipped: list[bool] = []
    out: dict[str, object] = {"skipped": skipped}
    try:
        for step in range(12):
            skipped.append(engine.train_step(*make_batch(GPT_CFG, 4, seed=step)).skipped)
    except Diverged as e:
        out["error"] = str(e)
    out["finite"] = all(bool(torch.isfinite(f.master).all()) for f in engine.zero.flats)
    engine.mesh.close()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_a_diverging_run_stops_with_finite_weights(worker_pools: PoolFactory, stage: int) -> None:
    """SGD at lr=1e6, fp32, no clipping: the steps whose gradient norm is not finite are
    skipped (the weights stay finite), and the third in a row raises `Diverged` on every rank."""
    for out in worker_pools(2).run(_diverge, stage, timeout=120):
        assert "training diverged: 3 steps in a row" in str(out.get("error")), out
        assert out["skipped"][-2:] == [True, True], out  # type: ignore[index]
        assert out["finite"], out


def _load_another_model(
    rank: int, path: str, saved_as: tuple[int, int, int], loaded_as: tuple[int, int, int]
) -> str:
    """Saved with a vocabulary of 32, loaded into the same configuration with a model of 40."""
    saver = _engine(_config(*saved_as))
    saver.save(path)
    saver.mesh.close()
    other = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
    model = GPT(other, seed=1)
    fresh = boost(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(*loaded_as))
    try:
        fresh.load(path)
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    else:
        outcome = "loaded"
    fresh.train_step(*make_batch(other, 4, seed=1))  # no rank is stuck in a collective
    fresh.mesh.close()
    return outcome


@pytest.mark.parametrize(
    ("saved_as", "loaded_as"),
    [((2, 1, 1), (2, 1, 1)), ((2, 1, 3), (2, 1, 3)), ((2, 1, 1), (1, 2, 0))],
    ids=["same-layout", "zero3", "another-topology"],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(
    worker_pools: PoolFactory, tmp_path: Path, saved_as: tuple[int, int, int], loaded_as: tuple[int, int, int]
) -> None:
    """A user's model of other shapes under the same configuration (which the fingerprint
    cannot tell apart): every rank refuses, naming the tensor and both shapes."""
    outcomes = worker_pools(2).run(
        _load_another_model, str(tmp_path / "ckpt"), saved_as, loaded_as, timeout=120
    )
    for outcome in outcomes:
        assert "[32, 16]" in outcome and "[40, 16]" in outcome, outcomes
        assert "embed.tok.weight" in outcome or "head.weight" in outcome, outcomes
