"""``keep_fp32``: chosen parameters and buffers computed in fp32 in a bf16 model.

A router or a score-correction bias kept in fp32 (what a Hugging Face family keeps in fp32 when
loaded in bf16) must be computed with its fp32 value: gathered, differentiated, reduced and
stepped in fp32, while the rest of the model computes in bf16.

Oracle: serial mixed precision written out by hand, one process, no ZeRO (as in
``test_zero_frozen.py``): the model cast to bf16 but for the kept parameters and buffer, which
are fp32; each parameter's fp32 master stepped by a torch SGD (momentum, weight decay) on the
mean over ranks of the per-rank gradients, summed in the dtype the parameter computes in, then
rounded into the model. Why ``TOL`` (1e-6, fp32 round-off of weights of about 0.3): both sides
compute the same per-rank forward and backward on the same weights, so the gradients agree bit
for bit; what may differ is the fp32 round-off of the update (and for bf16 buffers at most one
ulp of a two-rank sum, which ``test_zero_frozen.py`` measures exact here). A kept parameter
computed in bf16 instead is off by about ``lr * 2**-8 * |g|`` (1e-4) after one step.
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
from tessera.zero.precision import compute_dtype

D, H = 8, 32
STEPS = 3
LR, MOMENTUM, DECAY = 0.05, 0.9, 0.01
TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 0.0}
PARTS = ("inp", "mid", "out")


class Cast(nn.Linear):
    """A linear map computed in its weight's dtype (its input cast to it, its output cast back),
    plus a buffer ``shift`` added to its output: how an HF module kept in fp32 runs in bf16."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("shift", torch.full((d_out,), 0.1))

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x.to(self.weight.dtype), self.weight, self.bias) + self.shift.to(self.weight.dtype)
        return out.to(x.dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.inp, self.mid, self.out = Cast(D, H), Cast(H, H), Cast(H, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))  # type: ignore[no-any-return]


def batch(step: int, rank: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(4, D, generator=gen).to(dtype), torch.randn(4, D, generator=gen).to(dtype)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=DECAY)


def _kept(model: Net, keep: list[str]) -> list[Tensor]:
    """The parameters and the ``shift`` buffer of the modules ``keep``."""
    modules = [model.get_submodule(part) for part in keep]
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def serial(case: dict[str, Any]) -> dict[str, Tensor]:
    """The reference (module docstring)."""
    dtype = compute_dtype(case["precision"])
    model = Net()
    masters = [p.detach().clone() for p in model.parameters()]
    for part in PARTS:  # the kept ones hold their fp32 values
        model.get_submodule(part).to(torch.float32 if part in case["keep"] else dtype)
    opt = sgd(masters)
    params = list(model.parameters())
    for step in range(STEPS):
        total: list[Tensor] | None = None
        for rank in range(case["world"]):
            x, y = batch(step, rank, dtype)
            grads = torch.autograd.grad(F.mse_loss(model(x), y), params)
            total = list(grads) if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        assert total is not None
        for master, g in zip(masters, total, strict=True):
            master.grad = g.float() / case["world"]
        opt.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return {n: m for (n, _), m in zip(model.named_parameters(), masters, strict=True)}


def _train(rank: int, case: dict[str, Any], root: Path) -> dict[str, Any]:
    model = Net()
    memory = ChunkConfig(disk_dir=root / f"rank{rank}", chunk_numel=128, fractions=(0.0, 0.5, 0.5))
    zero = ZeroOptimizer(
        model,
        sgd(model.parameters()),
        stage=case["stage"],
        precision=case["precision"],
        offload=case["mode"] == "offload",
        bucket_bytes=1,  # one parameter per bucket: FlatParams of both dtypes share the spare buffers
        memory=memory if case["mode"] == "chunks" else None,
        keep_fp32=_kept(model, case["keep"]),
    )
    for step in range(STEPS):
        x, y = batch(step, rank, zero.dtype)
        zero.backward(F.mse_loss(zero.model(x), y))
        assert zero.step()
    with zero.gathered():  # what the model computes with
        dtypes = {n: p.dtype for n, p in zero.model.named_parameters()}
    out = {
        "params": zero.full_parameters(),
        "dtypes": dtypes | {n: b.dtype for n, b in zero.model.named_buffers()},
    }
    zero.close()
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.sampled_from([1, 2]),
    stage=st.sampled_from([0, 1, 2, 3]),
    mode=st.sampled_from(["flat", "offload", "chunks"]),
    keep=st.sets(st.sampled_from(PARTS), min_size=1, max_size=2),
)
def test_kept_parameters_and_buffers_compute_in_fp32_and_train_as_serially(
    tmp_path_factory: pytest.TempPathFactory, world: int, stage: int, mode: str, keep: set[str]
) -> None:
    """Any kept modules, any stage, flat, offloaded or chunked, in bf16: the kept parameters and
    buffers are fp32 where the model computes, the others bf16, and the masters equal the
    serial mixed-precision run's (``TOL``)."""
    case = {"world": world, "stage": stage, "mode": mode, "precision": "bf16", "keep": sorted(keep)}
    want = serial(case)
    for res in run_threaded(world, _train, case, tmp_path_factory.mktemp("keep")):
        for name, dtype in res["dtypes"].items():
            kept = name.split(".")[0] in keep
            assert dtype == (torch.float32 if kept else torch.bfloat16), (name, dtype)
        for name, value in want.items():
            torch.testing.assert_close(res["params"][name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
