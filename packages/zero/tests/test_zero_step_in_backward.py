"""Disk chunks stepped during backward (``ChunkConfig.step_in_backward``).

Oracle: the same run with ``step_in_backward=False`` (every chunk steps at ``step()``, the
gradient written to disk and read back), ranks as threads. The comparison is exact
(``torch.equal`` on every fp32 master and loss): the chunk steps with the same elementwise
arithmetic on the same values, only earlier. (``test_zero_chunks.py`` also holds chunked
runs, this path included, to runs without chunks.) Beside the values: the disk bytes say the
gradients never went to disk, a skipped step leaves nothing behind, and a second reduction
of a chunk already stepped is refused.
"""

from __future__ import annotations

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
from tessera.zero.chunks import ChunkConfig

D, H, STEPS = 8, 40, 3


class Net(nn.Module):
    """in -> Linear -> Tanh -> Linear -> out, seeded (about 2k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.inp = nn.Linear(D, H)
        self.mid = nn.Linear(H, H)
        self.out = nn.Linear(H, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))  # type: ignore[no-any-return]


def batch(step: int, rank: int, micro: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, D, generator=gen), torch.randn(4, D, generator=gen)


def build(case: dict[str, Any], disk: Path, early: bool) -> tuple[Net, ZeroOptimizer]:
    model = Net()
    opt = (
        torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        if case["opt"] == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    memory = ChunkConfig(
        disk_dir=disk, chunk_numel=case["chunk"], fractions=case["fractions"], step_in_backward=early
    )
    zero = ZeroOptimizer(
        model, opt, stage=case["stage"], precision=case["precision"], memory=memory, bucket_bytes=2048
    )
    return model, zero


def train(rank: int, case: dict[str, Any], disk: Path, early: bool) -> dict[str, Any]:
    """``STEPS`` steps (``micro`` microbatches each; ``nan_at``: that step's loss made NaN, so
    it is skipped); the losses, masters, disk bytes per step and files left pending."""
    model, zero = build(case, disk / f"{early}-{rank}", early)
    store = zero._chunks
    assert store is not None and store.disk is not None
    micro, losses, written, norms = case["micro"], [], [], []
    for step in range(STEPS):
        before = store.disk.bytes_written
        with zero.no_sync():
            for m in range(micro - 1):
                x, y = batch(step, rank, m)
                zero.backward(F.mse_loss(model(x.to(zero.dtype)), y.to(zero.dtype)) / micro)
        x, y = batch(step, rank, micro - 1)
        loss = F.mse_loss(model(x.to(zero.dtype)), y.to(zero.dtype)) / micro
        if step == case.get("nan_at"):
            loss = loss * float("nan")
        zero.backward(loss)
        assert zero.step() == (step != case.get("nan_at"))
        losses.append(loss.detach().float())
        norms.append(zero.last_grad_norm)
        written.append(store.disk.bytes_written - before)
    out = {
        "losses": torch.stack(losses),
        "norms": norms,
        "params": zero.full_parameters(),
        "written": written,
        "disk_numel": sum(c.numel for c in store.chunks if c.tier.value == "disk"),
        "pending": sorted(p.name for p in store.disk.dir.glob("*.next.npy")),
        "early": store.early is not None,
    }
    store.close()
    return out


CASE = {
    "opt": "adamw",
    "stage": 3,
    "precision": "fp32",
    "micro": 1,
    "chunk": 256,
    "fractions": (0.0, 0.0, 1.0),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.sampled_from([1, 2]),
    stage=st.sampled_from([1, 2, 3]),
    opt=st.sampled_from(["sgd", "adamw"]),
    precision=st.sampled_from(["fp32", "bf16"]),
    micro=st.sampled_from([1, 2]),
    chunk=st.integers(64, 700),
    disk_share=st.sampled_from([0.5, 1.0]),
)
def test_stepping_in_backward_equals_stepping_at_step_and_writes_no_gradient(
    tmp_path: Path,
    world: int,
    stage: int,
    opt: str,
    precision: str,
    micro: int,
    chunk: int,
    disk_share: float,
) -> None:
    case = {
        **CASE,
        "opt": opt,
        "stage": stage,
        "precision": precision,
        "micro": micro,
        "chunk": chunk,
        "fractions": (0.0, 1.0 - disk_share, disk_share),
    }
    got = run_threaded(world, train, case, tmp_path, True)
    want = run_threaded(world, train, case, tmp_path, False)
    for g, w in zip(got, want, strict=True):
        assert g["early"] and not w["early"]
        assert torch.equal(g["losses"], w["losses"]), (g["losses"], w["losses"])
        assert g["norms"] == w["norms"], (g["norms"], w["norms"])  # taken before the step
        bad = [n for n in w["params"] if not torch.equal(g["params"][n], w["params"][n])]
        assert not bad, {n: float((g["params"][n] - w["params"][n]).abs().max()) for n in bad}
        # the warm-up step writes the gradient as before; later steps 4 bytes an element less
        n = g["disk_numel"]
        assert n > 0 and g["written"][0] == w["written"][0], (g["written"], w["written"])
        for later_g, later_w in zip(g["written"][1:], w["written"][1:], strict=True):
            assert later_w - later_g == 4 * n, (g["written"], w["written"], n)
        assert g["pending"] == [], g["pending"]


@pytest.mark.parametrize("nan_at", [1, 2])
def test_a_non_finite_step_is_skipped_and_its_pending_files_dropped(tmp_path: Path, nan_at: int) -> None:
    case = {**CASE, "nan_at": nan_at}
    got = run_threaded(2, train, case, tmp_path, True)
    want = run_threaded(2, train, case, tmp_path, False)
    for g, w in zip(got, want, strict=True):
        assert g["early"]
        bad = [n for n in w["params"] if not torch.equal(g["params"][n], w["params"][n])]
        assert not bad, bad
        assert g["pending"] == [], g["pending"]
        # a skipped step wrote its pending streams (master, 2 moments) where the other wrote
        # the gradient alone
        assert g["written"][nan_at] == 3 * w["written"][nan_at] > 0, (g["written"], w["written"])


def _zero_grad_after_backward(
    rank: int, disk: Path
) -> tuple[dict[str, Tensor], dict[str, Tensor], list[str]]:
    model, zero = build(CASE, disk / str(rank), True)
    for step in range(2):  # the warm-up, then a step taken in backward
        x, y = batch(step, rank)
        zero.backward(F.mse_loss(model(x), y))
        zero.step()
    before = zero.full_parameters()
    x, y = batch(2, rank)
    zero.backward(F.mse_loss(model(x), y))
    assert zero._chunks is not None and zero._chunks.early is not None and zero._chunks.early.pending
    mid = zero.full_parameters()  # between backward and step: the committed values
    zero.zero_grad()
    after = zero.full_parameters()
    assert zero._chunks.disk is not None
    pending = sorted(p.name for p in zero._chunks.disk.dir.glob("*.next.npy"))
    zero._chunks.close()
    for name in before:
        assert torch.equal(mid[name], before[name]), name
    return before, after, pending


def test_zero_grad_after_backward_leaves_the_weights_and_no_files(tmp_path: Path) -> None:
    for before, after, pending in run_threaded(2, _zero_grad_after_backward, tmp_path):
        bad = [n for n in before if not torch.equal(before[n], after[n])]
        assert not bad, bad
        assert pending == [], pending


def _two_reductions(rank: int, disk: Path) -> None:
    model, zero = build(CASE, disk / str(rank), True)
    x, y = batch(0, rank)
    zero.backward(F.mse_loss(model(x), y))
    zero.step()
    zero.backward(F.mse_loss(model(x), y))
    zero.backward(F.mse_loss(model(x), y))  # reduces again, outside no_sync


def test_a_second_reduction_before_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"already stepped in this backward \(zero.step_in_backward\)"):
        run_threaded(1, _two_reductions, tmp_path)


def _early_with(rank: int, disk: Path, clip: float | None, precision: str) -> bool:
    model = Net()
    zero = ZeroOptimizer(
        model,
        torch.optim.AdamW(model.parameters()),
        stage=3,
        precision=precision,
        clip_grad_norm=clip,
        memory=ChunkConfig(disk_dir=disk / str(rank), chunk_numel=256, fractions=(0.0, 0.0, 1.0)),
    )
    assert zero._chunks is not None
    early = zero._chunks.early is not None
    zero._chunks.close()
    return early


@pytest.mark.parametrize(
    ("clip", "precision", "early"), [(None, "fp32", True), (1.0, "fp32", False), (None, "fp16", False)]
)
def test_only_a_factor_known_before_backward_steps_in_it(
    tmp_path: Path, clip: float | None, precision: str, early: bool
) -> None:
    """Clipping needs the whole gradient's norm, and fp16 loss scaling its overflow check,
    before any chunk steps: both step at ``step()``, as before."""
    assert run_threaded(1, _early_with, tmp_path, clip, precision) == [early]
