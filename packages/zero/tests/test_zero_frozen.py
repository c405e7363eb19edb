"""Frozen parameters keep only their compute-dtype values: training and the bytes held.

Oracle for training: serial mixed precision written out by hand, one process, no ZeRO: the
model cast to the compute dtype, each trainable parameter's fp32 master stepped by a torch
SGD (momentum, weight decay) on the mean over ranks of the per-rank gradients, summed in
the compute dtype as the reduce sums the ranks' flat buffers, then rounded into the model;
the frozen parameters never touched. ZeRO (stages 0-3, flat, with offload and with the
chunk memory manager) must keep every frozen parameter at exactly its bf16 value and end
with trainable masters within ``TOL`` of the reference. Why ``TOL``: both sides compute
the same per-rank forward and backward on the same compute-dtype weights and inputs, so
the gradients agree bit for bit; what may differ is how a backend sums the two ranks' bf16
buffers (in fp32 then rounded once, as ``a + b`` does, or otherwise: at most one bf16 ulp of
that sum, 2**-8 relative) and fp32 round-off in the update. One bf16 ulp of a gradient
changes a master by lr * 2**-8 * |g| (about 1e-4 here) and can then flip a compute weight
to the neighbouring bf16 value, so a tolerance that admitted it would be near bf16's own
resolution and prove little; runs here are exact, and ``TOL`` (1e-6, fp32 round-off of
weights of about 0.3) fails on any bf16-level difference.

Oracle for memory: the same model with every parameter trainable, whose FlatParams have the
same layouts (one parameter per bucket at stages 0-2, one frozen or trained module per
unit at stage 3). Before frozen FlatParams dropped their fp32 masters the two held the same
parameter bytes; now the frozen model holds exactly 4 bytes per frozen shard element less
wherever a separate master exists (bf16, or offload), and nothing less in fp32 (the shard
was the master), besides having no optimizer state nor gradient buffer for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.chunks import ChunkConfig, Tier
from tessera.zero.precision import compute_dtype

D, H = 8, 48
STEPS = 3
LR, MOMENTUM, DECAY = 0.05, 0.9, 0.01
TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 0.0}
PARTS = ("inp", "body.0", "body.2", "out", "body.2.bias")  # modules, and one bias alone


class Net(nn.Module):
    """in -> Linear -> Tanh -> [Linear, Tanh, Linear] -> out (about 5k parameters); the named
    ``frozen`` parts (modules or single parameters) take no gradient."""

    def __init__(self, frozen: tuple[str, ...] = ()) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D, H)
        self.body = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))
        self.out = nn.Linear(H, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for part in frozen:
            target = self.get_submodule(part) if part != "body.2.bias" else self.get_parameter(part)
            target.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.body(torch.tanh(self.inp(x))))  # type: ignore[no-any-return]


def batch(step: int, rank: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(4, D, generator=gen).to(dtype), torch.randn(4, D, generator=gen).to(dtype)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=DECAY)


def memory_for(mode: str, root: Path) -> ChunkConfig | None:
    """The chunk manager's settings of ``mode`` (half the chunks on the host, half on disk)."""
    if mode == "chunks":
        return ChunkConfig(disk_dir=root, chunk_numel=128, fractions=(0.0, 0.5, 0.5))
    if mode == "chunks-disk":
        return ChunkConfig(disk_dir=root, chunk_numel=128, fractions=(0.0, 0.0, 1.0))
    if mode == "chunks-host":
        return ChunkConfig(chunk_numel=128)
    return None


def build(case: dict[str, Any], frozen: tuple[str, ...], root: Path) -> ZeroOptimizer:
    model = Net(frozen)
    return ZeroOptimizer(
        model,
        sgd([p for p in model.parameters() if p.requires_grad]),  # as a fine-tuning script builds it
        stage=case["stage"],
        precision=case["precision"],
        offload=case["mode"] == "offload",
        bucket_bytes=1,  # one parameter per bucket: the memory oracle's layouts match
        memory=memory_for(case["mode"], root),
    )


def serial(case: dict[str, Any]) -> dict[str, Tensor]:
    """The reference (module docstring): trainable fp32 masters and frozen compute values."""
    dtype = compute_dtype(case["precision"])
    model = Net(tuple(case["frozen"]))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().clone() for _, p in trained]
    model.to(dtype)
    opt = sgd(masters)
    for step in range(STEPS):
        total: list[Tensor] | None = None
        for rank in range(case["world"]):
            x, y = batch(step, rank, dtype)
            grads = torch.autograd.grad(F.mse_loss(model(x), y), [p for _, p in trained])
            total = list(grads) if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        assert total is not None
        for master, g in zip(masters, total, strict=True):
            master.grad = g.float() / case["world"]
        opt.step()
        with torch.no_grad():
            for (_, p), master in zip(trained, masters, strict=True):
                p.copy_(master)
    out = {n: p.detach().float() for n, p in model.named_parameters()}
    return out | {n: m for (n, _), m in zip(trained, masters, strict=True)}


def _train(rank: int, case: dict[str, Any], root: Path) -> dict[str, Any]:
    zero = build(case, tuple(case["frozen"]), root / f"rank{rank}")
    for step in range(STEPS):
        x, y = batch(step, rank, zero.dtype)
        zero.backward(F.mse_loss(zero.model(x), y))
        assert zero.step()
    frozen = [f for f in zero.flats if f.frozen]
    with zero.gathered():  # what the model computes with
        dtypes = {p.dtype for p in zero.model.parameters()}
    out = {
        "params": zero.full_parameters(),
        "dtypes": dtypes,
        "frozen_master_is_shard": all(f.master is f.shard for f in frozen),
        "frozen_grads": [f.shard.grad for f in frozen] + [p.grad for f in frozen for p in f.params],
        "frozen_state": [zero.optimizer.state.get(f.master) for f in frozen],
        "frozen_chunks": None,
    }
    if zero._chunks is not None:
        chunks = [c for c in zero._chunks.chunks if c.frozen]
        out["frozen_chunks"] = [(c.dtype, zero._chunks.present(c), c.scalars) for c in chunks]
    zero.close()
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.sampled_from([1, 2]),
    stage=st.sampled_from([0, 1, 2, 3]),
    mode=st.sampled_from(["flat", "offload", "chunks"]),
    precision=st.sampled_from(["bf16", "bf16", "fp32"]),
    frozen=st.sets(st.sampled_from(PARTS), min_size=1, max_size=3),  # one module at least trains
)
def test_frozen_values_stay_in_the_compute_dtype_and_the_rest_equal_serial(
    tmp_path_factory: pytest.TempPathFactory,
    world: int,
    stage: int,
    mode: str,
    precision: str,
    frozen: set[str],
) -> None:
    """Any set of frozen modules or parameters, any stage, flat, offloaded or chunked: the
    frozen parameters hold exactly their compute-dtype values (no master, gradient or state
    exists for them), the trainable masters equal the serial mixed-precision run (``TOL``)."""
    case = {"world": world, "stage": stage, "mode": mode, "precision": precision, "frozen": sorted(frozen)}
    want = serial(case)
    dtype = compute_dtype(precision)
    start = Net()
    for res in run_threaded(world, _train, case, tmp_path_factory.mktemp("frozen")):
        for name, p in start.named_parameters():
            if any(name == part or name.startswith(part + ".") for part in frozen):
                assert torch.equal(res["params"][name], p.detach().to(dtype).float()), name
        torch.testing.assert_close(res["params"], want, **TOL)
        assert res["dtypes"] == {dtype}
        assert res["frozen_master_is_shard"]
        assert all(g is None for g in res["frozen_grads"])
        assert all(s is None for s in res["frozen_state"])
        if res["frozen_chunks"] is not None:  # stage 3 only: at 0-2 the store holds none of them
            assert bool(res["frozen_chunks"]) == (stage == 3)
            assert all(c == (dtype, ["master"], {}) for c in res["frozen_chunks"])


# ---------------------------------------------------------------------- bytes held
BACKBONE = ("inp", "body.0", "body.2")  # whole modules: a unit of their own at stage 3


def _bytes(rank: int, case: dict[str, Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, frozen in (("frozen", BACKBONE), ("trained", ())):
        zero = build(case, frozen, root / f"{kind}{rank}")
        x, y = batch(0, rank, zero.dtype)
        zero.backward(F.mse_loss(zero.model(x), y))
        assert zero.step()
        report = zero.memory()
        out[kind] = {
            "parameters": report.parameters,
            "gradients": report.gradients,
            "optimizer_state": report.optimizer_state,
            "chunks": zero.chunk_report(),
            "backbone_shards": sum(
                f.layout.shard_numel
                for f in zero.flats
                if {n.rsplit(".", 1)[0] for n in f.names} <= set(BACKBONE)
            ),
            "shards": sum(f.layout.shard_numel for f in zero.flats),
        }
        zero.close()
    return out


@pytest.mark.parametrize("mode", ["flat", "offload"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_shard_holds_no_master_gradient_or_state_bytes(
    tmp_path: Path, stage: int, precision: str, mode: str
) -> None:
    """After a step, by ``memory()``: the frozen backbone's parameter bytes are a trained
    one's less its fp32 master (4 bytes per shard element; none in fp32 without offload,
    where the shard was the master already, so fp32 is unchanged), and it has no optimizer
    state (SGD momentum: 4 bytes) and, with offload, no host gradient buffer (4 bytes)."""
    case = {"stage": stage, "precision": precision, "mode": mode}
    for res in run_threaded(2, _bytes, case, tmp_path):
        frozen, trained = res["frozen"], res["trained"]
        n = trained["backbone_shards"]
        assert n == frozen["backbone_shards"] > 0 and trained["shards"] == frozen["shards"]  # same layouts
        master = 4 * n if precision != "fp32" or mode == "offload" else 0
        assert trained["parameters"] - frozen["parameters"] == master
        assert trained["optimizer_state"] - frozen["optimizer_state"] == 4 * n
        assert trained["gradients"] - frozen["gradients"] == (4 * n if mode == "offload" else 0)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_chunks_count_at_the_compute_dtype(tmp_path: Path, stage: int, precision: str) -> None:
    """With the chunk manager, by its report: at stage 3 a frozen chunk holds the compute-dtype
    values alone (2 bytes an element in bf16 against a trained chunk's 12: master, gradient,
    momentum), in the tier budgets and in memory after a step; at stages 0-2 the frozen
    values are the full parameters every rank keeps anyway, and no chunk duplicates them."""
    case = {"stage": stage, "precision": precision, "mode": "chunks-host"}
    size = compute_dtype(precision).itemsize
    for res in run_threaded(2, _bytes, case, tmp_path):
        frozen, trained = res["frozen"]["chunks"], res["trained"]["chunks"]
        n, total = res["frozen"]["backbone_shards"], res["frozen"]["shards"]
        assert trained["bytes_per_element"] == frozen["bytes_per_element"] == 12
        assert trained["host"]["bytes"] == 12 * total
        held = size * n if stage == 3 else 0
        assert frozen["frozen"]["bytes"] == held
        assert frozen["host"]["bytes"] == 12 * (total - n) + held
        # after the step: trained chunks hold master and momentum (the gradient is dropped)
        assert frozen["resident_bytes"]["host"] == 8 * (total - n) + held
        assert trained["resident_bytes"]["host"] == 8 * total


# ---------------------------------------------------------------------- the disk tier
def _disk(rank: int, root: Path) -> dict[str, Any]:
    case = {"stage": 3, "precision": "bf16", "mode": "chunks-disk"}
    zero = build(case, BACKBONE, root / f"rank{rank}")
    store = zero._chunks
    assert store is not None and store.disk is not None
    frozen = [c for c in store.chunks if c.frozen]
    assert frozen and all(c.tier is Tier.DISK for c in store.chunks)
    files = [store.disk.path(c.index, "master") for c in frozen]
    before = [(os.stat(f).st_ino, os.stat(f).st_mtime_ns) for f in files]
    written = store.disk.bytes_written
    for step in range(2):
        x, y = batch(step, rank, zero.dtype)
        zero.backward(F.mse_loss(zero.model(x), y))
        assert zero.step()
    after = [(os.stat(f).st_ino, os.stat(f).st_mtime_ns) for f in files]
    import numpy as np

    chunk = frozen[0]
    raw = torch.from_numpy(np.load(files[0], allow_pickle=False)).view(torch.bfloat16)
    out = {
        "unchanged": before == after,
        "written": store.disk.bytes_written - written,
        "trained_elements": sum(c.numel for c in store.chunks if not c.frozen),
        "raw_is_master": torch.equal(raw, store.master(chunk.flat_index)[chunk.lo : chunk.hi]),
        "read": store.disk.bytes_read,
    }
    zero.close()
    return out


def test_frozen_disk_chunks_are_only_read_after_they_are_placed(tmp_path: Path) -> None:
    """Stage 3, bf16, every chunk on disk: training reads the frozen chunks (each gather
    refills the shard from them) but never rewrites their files; the disk writes of two steps
    are the trained chunks' alone (per element: gradient, master, momentum, 4 bytes each, at
    the first step; master and momentum at the second, which steps in backward and writes no
    gradient). A frozen bf16 file is a plain .npy of the raw bits (int16)."""
    for res in run_threaded(2, _disk, tmp_path):
        assert res["unchanged"] and res["raw_is_master"] and res["read"] > 0
        assert res["written"] == (12 + 8) * res["trained_elements"], res
