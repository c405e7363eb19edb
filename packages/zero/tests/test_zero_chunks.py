"""The chunk memory manager: training with it equals training without it.

Oracle: the same ``ZeroOptimizer`` (stage, world, precision, optimizer) without ``memory``,
on the same batches, ranks as threads. The comparison is exact (``torch.equal`` on losses
and on every fp32 master) for SGD-with-momentum and AdamW alike, not within a tolerance:
the chunked step applies the same elementwise operations to the same fp32 values (each
chunk is one optimizer parameter that is a slice of the shard the reference steps whole),
and chunk boundaries are multiples of 64 elements, so no element changes its place in a
vector lane or a thread's range relative to the reference. The one thing the chunks
compute in another order is the gradient norm (summed over chunks instead of flat
buffers): it only matters when clipping, so the clipping cases compare SGD weights to
1e-6 and AdamW weights by ``assert_adam_close`` (the bounds of test_zero_threaded.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm.testing import assert_adam_close, run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.chunks import ChunkConfig, ChunkFileError, Tier
from tessera.zero.chunks.tracer import MemoryTracer

D, H = 8, 48
STEPS = 3


class Net(nn.Module):
    """in -> Linear -> Tanh -> [Linear, Tanh, Linear] -> out (about 5k parameters: many chunks)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D, H)
        self.body = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))
        self.out = nn.Linear(H, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.body(torch.tanh(self.inp(x))))  # type: ignore[no-any-return]


def batch(step: int, rank: int, micro: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(4, D, generator=gen), torch.randn(4, D, generator=gen)


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups: Any = [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, eps=1e-6)


def train(rank: int, case: dict[str, Any], memory: ChunkConfig | None) -> dict[str, Any]:
    """``STEPS`` steps of ``case``; the losses, the fp32 masters and the chunk report."""
    model = Net()
    zero = ZeroOptimizer(
        model,
        make_optimizer(model, case["opt"]),
        stage=case["stage"],
        precision=case.get("precision", "fp32"),
        clip_grad_norm=case.get("clip"),
        bucket_bytes=case.get("bucket", 4096),
        memory=memory,
        # as if tensor parallelism held the body's second layer on 3 ranks: counted 1/3 in the norm
        replication={p: 3 for p in model.body[2].parameters()} if case.get("replication") else None,
    )
    micro = case.get("micro", 1)
    dtype = zero.dtype
    losses = []
    for step in range(STEPS):
        with zero.no_sync():
            for m in range(micro - 1):
                x, y = batch(step, rank, m)
                zero.backward(F.mse_loss(model(x.to(dtype)), y.to(dtype)) / micro)
        x, y = (t.to(dtype) for t in batch(step, rank, micro - 1))
        loss = F.mse_loss(model(x), y) / micro
        zero.backward(loss)
        assert zero.step()
        losses.append(loss.detach().float())
    out = {"losses": torch.stack(losses), "params": zero.full_parameters(), "report": None}
    if zero._chunks is not None:
        out["report"] = zero._chunks.report()
        zero._chunks.close()
    return out


def compare(case: dict[str, Any], memory: ChunkConfig) -> list[dict[str, Any]]:
    """Train ``case`` with and without ``memory`` and compare (module docstring)."""
    want = run_threaded(case["world"], train, case, None)
    got = run_threaded(case["world"], train, case, memory)
    for g, w in zip(got, want, strict=True):
        if case.get("clip") is None:
            assert torch.equal(g["losses"], w["losses"]), (g["losses"], w["losses"])
            bad = [n for n in w["params"] if not torch.equal(g["params"][n], w["params"][n])]
            assert not bad, {n: float((g["params"][n] - w["params"][n]).abs().max()) for n in bad}
        elif case["opt"] == "sgd":
            torch.testing.assert_close(g["params"], w["params"], atol=1e-6, rtol=1e-5)
        else:
            assert_adam_close(g["params"], w["params"], lr=0.02, steps=STEPS)
    return got


# ---------------------------------------------------------------------- equivalence
TIER_MIXES = ["host", "disk", "host+disk", "fractions", "auto"]


def memory_for(
    mix: str, chunk_numel: int, host_share: float, disk_dir: Path, opt: str, prefetch: bool
) -> ChunkConfig:
    """A ChunkConfig putting chunks on the tiers of ``mix`` (host budget: staging plus
    ``host_share`` of the model data, about)."""
    elem = 12 if opt == "sgd" else 16  # master, gradient, momentum / exp_avg and exp_avg_sq
    staging = (3 if prefetch else 2) * (-(-chunk_numel // 64) * 64) * elem / 2**20  # + optimizer scratch
    data = 5500 * elem / 2**20
    if mix == "host":
        return ChunkConfig(chunk_numel=chunk_numel, prefetch=prefetch)
    if mix == "disk":
        return ChunkConfig(
            host_budget_mb=staging, disk_dir=disk_dir, chunk_numel=chunk_numel, prefetch=prefetch
        )
    if mix == "fractions":
        return ChunkConfig(
            disk_dir=disk_dir,
            chunk_numel=chunk_numel,
            fractions=(0.0, host_share, 1 - host_share),
            prefetch=prefetch,
        )
    if mix == "auto":  # starts on disk; after the warm-up moves what the budget allows to the host
        return ChunkConfig(
            policy="auto", host_budget_mb=256, disk_dir=disk_dir, chunk_numel=chunk_numel, prefetch=prefetch
        )
    return ChunkConfig(
        host_budget_mb=staging + host_share * data,
        disk_dir=disk_dir,
        chunk_numel=chunk_numel,
        prefetch=prefetch,
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # "explain" reruns for minutes
)
@given(
    world=st.sampled_from([1, 2]),
    stage=st.sampled_from([0, 1, 2, 3]),
    opt=st.sampled_from(["sgd", "adamw"]),
    mix=st.sampled_from(TIER_MIXES),
    chunk_numel=st.integers(100, 2000),
    host_share=st.floats(0.0, 1.0),
    prefetch=st.booleans(),
)
def test_chunks_equal_no_chunks(
    tmp_path: Path,
    world: int,
    stage: int,
    opt: str,
    mix: str,
    chunk_numel: int,
    host_share: float,
    prefetch: bool,
) -> None:
    memory = memory_for(mix, chunk_numel, host_share, tmp_path, opt, prefetch)
    got = compare({"world": world, "stage": stage, "opt": opt}, memory)
    report = got[0]["report"]
    if mix == "disk":
        assert report["host"]["chunks"] == 0 and report["disk"]["chunks"] == report["chunks"]
        assert report["disk_read"] > 0 and report["disk_written"] > 0
    if mix == "host":
        assert report["host"]["chunks"] == report["chunks"] and report["disk_read"] == 0
    if mix == "auto":  # the warm-up ran on disk, then (256 MiB being ample) everything moved up
        assert report["host"]["chunks"] == report["chunks"] and report["disk_written"] > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_clipping_and_accumulation(tmp_path: Path, stage: int, opt: str) -> None:
    case = {"world": 2, "stage": stage, "opt": opt, "clip": 0.3, "micro": 2}
    compare(case, ChunkConfig(host_budget_mb=0.05, disk_dir=tmp_path, chunk_numel=128))


@pytest.mark.parametrize("stage", [0, 3])
def test_replicated_parameters_weigh_in_the_clipped_norm_as_without_chunks(
    tmp_path: Path, stage: int
) -> None:
    """The chunks' gradient norm weights replicated pieces (``replication``) as the flat
    buffers' does: the clip coefficient, hence the weights, agree (SGD bound)."""
    case = {"world": 2, "stage": stage, "opt": "sgd", "clip": 0.2, "replication": True}
    compare(case, ChunkConfig(host_budget_mb=0.05, disk_dir=tmp_path, chunk_numel=100))


@pytest.mark.parametrize("stage", [2, 3])
def test_mixed_precision(tmp_path: Path, stage: int) -> None:
    """bf16 compute over fp32 masters in chunks: the compute shard is refreshed from them."""
    case = {"world": 2, "stage": stage, "opt": "adamw", "precision": "bf16"}
    compare(case, ChunkConfig(host_budget_mb=0.05, disk_dir=tmp_path, chunk_numel=200))


def test_auto_places_by_the_measured_non_model_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` starts on the slowest tier, then after the warm-up gives the host what the
    budget leaves beside the (here: pinned) measured non-model memory, in use order."""
    monkeypatch.setattr(MemoryTracer, "stop", lambda self: (40_000, 0))
    memory = ChunkConfig(policy="auto", host_budget_mb=0.1, disk_dir=tmp_path, chunk_numel=256)
    (res,) = compare({"world": 1, "stage": 3, "opt": "adamw"}, memory)
    report = res["report"]
    assert report["non_model_bytes"]["host"] == 40_000
    room = round(0.1 * 2**20) - 40_000 - report["staging_bytes"] - report["scratch_bytes"]
    assert 0 < report["host"]["bytes"] <= room < report["host"]["bytes"] + 256 * 16
    assert report["disk"]["chunks"] > 0


def test_auto_budget_below_the_measured_non_model_memory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MemoryTracer, "stop", lambda self: (10 * 2**20, 0))
    memory = ChunkConfig(policy="auto", host_budget_mb=1, disk_dir=tmp_path, chunk_numel=256)
    with pytest.raises(
        ValueError, match=r"host_budget_mb=1 cannot hold the working set: .* MiB of measured non-model memory"
    ):
        run_threaded(1, train, {"world": 1, "stage": 3, "opt": "adamw"}, memory)


# ---------------------------------------------------------------------- errors, report
def _zero(rank: int, memory: ChunkConfig, offload: bool = False) -> ZeroOptimizer:
    model = Net()
    return ZeroOptimizer(model, make_optimizer(model, "adamw"), stage=3, memory=memory, offload=offload)


def test_budget_that_cannot_hold_the_model_is_one_line_error_before_training() -> None:
    with pytest.raises(
        ValueError, match=r"the model data needs 0.08\d* MiB in chunks but the tiers hold 0.009\d* MiB"
    ) as e:
        run_threaded(1, _zero, ChunkConfig(host_budget_mb=0.01, chunk_numel=64))
    assert (
        str(e.value).splitlines()[0].endswith("raise a budget or give disk_dir")
    )  # one line (the rest: the harness's note)
    # below the working set counted at its least (8 bytes an element): refused by the config itself
    lowest = r"host_budget_mb=0.01 cannot hold the chunk manager's working set: .* = 0.09375 MiB"
    with pytest.raises(ValueError, match=lowest):
        ChunkConfig(host_budget_mb=0.01, disk_dir="/tmp", chunk_numel=4096)
    # above that, below AdamW's (16 bytes an element: 0.1875 MiB): refused when the store is built
    with pytest.raises(ValueError, match="cannot hold the working set"):
        run_threaded(1, _zero, ChunkConfig(host_budget_mb=0.15, disk_dir="/tmp", chunk_numel=4096))


def test_offload_and_memory_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        run_threaded(1, _zero, ChunkConfig(), True)


def test_start_report_says_where_each_chunk_went(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    memory = ChunkConfig(host_budget_mb=0.05, disk_dir=tmp_path, chunk_numel=256)
    with caplog.at_level(logging.DEBUG, logger="tessera.zero.chunks"):
        (zero,) = run_threaded(1, _zero, memory)
    assert zero._chunks is not None
    report = zero._chunks.report()
    assert report["host"]["chunks"] + report["disk"]["chunks"] == report["chunks"] == len(report["placement"])
    assert report["host"]["bytes"] + report["staging_bytes"] + report["scratch_bytes"] <= 0.05 * 2**20
    assert report["bytes_per_element"] == 16  # master, gradient, exp_avg, exp_avg_sq
    text = caplog.text
    assert "chunk manager placed (static)" in text and "disk" in text and str(tmp_path) in text
    assert sum(f"chunk {i}:" in text for i in range(report["chunks"])) == report["chunks"]
    zero._chunks.close()


def _break_disk(rank: int, tmp: Path, how: str) -> None:
    model = Net()
    zero = ZeroOptimizer(
        model,
        make_optimizer(model, "adamw"),
        stage=3,
        memory=ChunkConfig(host_budget_mb=0.01, disk_dir=tmp, chunk_numel=64),
    )
    assert zero._chunks is not None and zero._chunks.disk is not None
    chunk = next(c for c in zero._chunks.chunks if c.tier is Tier.DISK)
    victim = zero._chunks.disk.path(chunk.index, "master")
    if how == "missing":
        victim.unlink()
    elif how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-8])
    else:
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF
        victim.write_bytes(bytes(data))
    x, y = batch(0, rank)
    zero.backward(F.mse_loss(model(x), y))  # the stage-3 gathers read every master


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", r"chunk (\d+) stream 'master': .*chunk-0*\1-master.npy is missing"),
        ("truncated", r"chunk \d+ stream 'master': .* is truncated \(248 of 256 data bytes\)"),
        ("flipped", r"chunk \d+ stream 'master': .* does not hold what was written \(CRC-32"),
    ],
)
def test_corrupt_or_missing_disk_files_are_clear_errors(tmp_path: Path, how: str, message: str) -> None:
    with pytest.raises(ChunkFileError, match=message):
        run_threaded(1, _break_disk, tmp_path, how)


class Reversed(nn.Module):
    """Two layers registered as ``first``, ``second`` but run ``second`` then ``first``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.second = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        return self.first(torch.tanh(self.second(x)))  # type: ignore[no-any-return]


def _order(rank: int, tmp: Path) -> tuple[list[int], list[int]]:
    model = Reversed()
    zero = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        stage=3,
        memory=ChunkConfig(host_budget_mb=0.0015, disk_dir=tmp, chunk_numel=64),
    )
    store = zero._chunks
    assert store is not None
    before = [c.flat_index for c in store.order]
    x, y = batch(0, rank)
    zero.backward(F.mse_loss(model(x), y))
    zero.step()
    after = [c.flat_index for c in store.order]
    store.close()
    return before, after


def test_the_warm_up_step_records_the_order_of_use(tmp_path: Path) -> None:
    """Before the first step chunks go in FlatParam order (``first`` = flat 0); the warm-up
    records the forward's gathers, ``second`` first, and the step and prefetch follow it."""
    ((before, after),) = run_threaded(1, _order, tmp_path)
    assert before == sorted(before) and before[0] == 0
    assert after[0] == 1 and after[-1] == 0 and sorted(after) == sorted(before)


def test_disk_files_are_plain_npy_arrays(tmp_path: Path) -> None:
    """What the disk tier writes is what ``numpy.load`` reads (without pickle) as the stream."""
    import numpy as np

    (zero,) = run_threaded(1, _zero, ChunkConfig(host_budget_mb=0.01, disk_dir=tmp_path, chunk_numel=64))
    store = zero._chunks
    assert store is not None and store.disk is not None
    chunk = next(c for c in store.chunks if c.tier is Tier.DISK)
    array = np.load(store.disk.path(chunk.index, "master"), allow_pickle=False)
    assert array.dtype == np.float32 and array.shape == (chunk.numel,)
    master = store.master(chunk.flat_index)[chunk.lo : chunk.hi]
    assert torch.equal(torch.from_numpy(array), master)
    store.close()
