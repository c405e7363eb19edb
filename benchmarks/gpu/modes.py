"""Every mode of ``boost()`` against the same model trained serially, on one device.

The model is ``tessera.models.Llamaish`` (RMSNorm, rotary positions, SwiGLU, grouped-query
attention calling ``F.scaled_dot_product_attention``), given to ``boost()`` with nothing but
a plan of roles, as a user brings their own model; SGD with momentum, fp32, no clipping. Each
mode trains ``steps`` steps on the same global batches as the serial run (one process, plain
PyTorch, on the same device) and is held to it:

- losses, rel 1e-5 on the CPU: a mean of token losses in fp32 summed in another order by the
  ranks; rel 1e-4 on CUDA, whose fp32 kernels (cuBLAS's split reductions, atomic adds in the
  embedding's backward) also sum in orders that vary from run to run;
- weights, rtol 1e-5 + atol 1e-6 on the CPU (SGD's update is linear in the gradient: the
  difference stays at round-off), rtol 1e-4 + atol 1e-5 on CUDA for the same reason as the
  losses. A partial gradient, a wrong shard or a lost contribution moves a weight by about
  an update (lr 0.5 x a gradient of order 1e-2), far outside either bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import TPMode
from tessera.comm.sequence_modes import Layout, Mode
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.models import LLAMAISH_ROLES, ForeignConfig, Llamaish
from tessera.zero.precisions import Precision

__all__ = ["MODES", "P2P_MODES", "Sizes", "compare", "parallel_run", "serial_run", "sizes"]

ROLES = LLAMAISH_ROLES  # what each module of the user's model is; every mode turns it into its own layers


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The model, batch and steps of the mode checks."""

    model: ForeignConfig
    seq: int
    batch: int
    steps: int


def sizes(size: str) -> Sizes:
    """``tiny``: seconds on a CPU; ``full``: a model whose steps keep one GPU busy."""
    if size == "tiny":
        return Sizes(ForeignConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, hidden=48), 16, 8, 2)
    model = ForeignConfig(vocab=1024, dim=256, heads=4, kv_heads=2, layers=4, hidden=704, max_len=256)
    return Sizes(model, 256, 16, 3)


P = ParallelConfig
Z = ZeroConfig
# name: (parallel layout, zero settings, whether it needs CUDA)
MODES: dict[str, tuple[ParallelConfig, ZeroConfig, bool]] = {
    "dp2-zero1": (P(dp=2), Z(stage=1), False),
    "dp2-zero2": (P(dp=2), Z(stage=2), False),
    "dp2-zero3": (P(dp=2), Z(stage=3), False),
    "tp2-sp": (P(tp=2, sequence_parallel=True), Z(), False),
    "2d": (P(tp=4, tp_mode=TPMode.TWO_D), Z(), False),
    "2.5d": (P(tp=8, tp_mode=TPMode.TWO_P5_D, tp_depth=2, microbatches=1), Z(), False),
    "3d": (P(tp=8, tp_mode=TPMode.THREE_D, microbatches=1), Z(), False),
    "cp2-ring": (P(cp=2, cp_layout=Layout.ZIGZAG), Z(), False),
    "cp2-ulysses": (P(cp=2, cp_mode=Mode.ULYSSES), Z(), False),
    "pp2-1f1b": (P(pp=2, microbatches=2, schedule="1f1b"), Z(), False),
    "dp2-zero3-offload": (P(dp=2), Z(stage=3, offload=True), False),  # host buffers pinned on CUDA
    # the chunk manager's device tier (only on an accelerator): a budget for about half of each
    # rank's model data on the device (`config_of` sizes it), the rest on the host
    "dp2-zero3-device-tier": (P(dp=2), Z(stage=3, device_budget_mb=1.0, host_budget_mb=4096.0), True),
    "nccl-zero1": (P(dp=1), Z(stage=1), True),  # world 1: NCCL's init and collectives
}


P2P_MODES = ("pp2-1f1b", "cp2-ring")  # their messages are point-to-point (gloo: CPU tensors only?)


def model_of(s: Sizes, device: str) -> nn.Module:
    return Llamaish(s.model, seed=0).to(device)


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def batch_of(s: Sizes, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, s.model.vocab, (s.batch, s.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


Run = tuple[list[float], dict[str, Tensor]]


def serial_run(rank: int, s: Sizes, device: str) -> Run:
    """The reference: plain PyTorch, one process, the whole batch."""
    model = model_of(s, device)
    opt = optimizer_of(model)
    losses = []
    for step in range(s.steps):
        ids, targets = (t.to(device) for t in batch_of(s, step))
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def config_of(mode: str, s: Sizes) -> Config:
    """The job's configuration for ``mode``: its layout and ZeRO settings, fp32, no clipping."""
    parallel, zero, _ = MODES[mode]
    if zero.device_budget_mb > 0:  # fp32 weights, gradients and momentum, sharded over dp
        c = s.model
        params = 2 * c.vocab * c.dim + c.layers * (
            2 * c.dim * c.dim + 2 * c.dim * c.dim * c.kv_heads // c.heads
        )
        params += c.layers * 3 * c.dim * c.hidden
        per_rank = 12 * params / parallel.dp
        zero = dataclasses.replace(
            zero, device_budget_mb=0.5 * per_rank / 2**20, chunk_numel=4096 if c.dim < 128 else 65536
        )
    base = Config(parallel=parallel, zero=zero, train=TrainConfig(precision=Precision.FP32))
    return dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, batch_size=s.batch),
        optim=dataclasses.replace(base.optim, clip_grad_norm=0.0),
    )


def parallel_run(
    rank: int, mode: str, s: Sizes, device: str
) -> tuple[list[float], dict[str, Tensor], dict[str, Any]]:
    """``mode`` through ``boost()`` on this rank: losses, this rank's full weights (CPU), facts."""
    model = model_of(s, device)
    engine = boost(model, optimizer_of(model), config_of(mode, s), plan=ROLES)
    losses = [engine.train_step(*batch_of(s, step)).loss for step in range(s.steps)]
    weights = {n: t.cpu() for n, t in engine.full_state_dict().items()}
    facts: dict[str, Any] = {"mesh_device": str(engine.mesh.device)}
    report = engine.zero.chunk_report()
    if report is not None:  # chunks per tier on this rank
        facts["chunks"] = {tier: report[tier]["chunks"] for tier in ("device", "host", "disk")}
    if MODES[mode][1].offload:
        from tessera.zero.offload import host_empty

        facts["host_pinned"] = bool(host_empty(1).is_pinned())
    engine.mesh.close()
    return losses, weights, facts


def compare(
    results: list[tuple[list[float], dict[str, Tensor], dict[str, Any]]], serial: Run, device: str
) -> dict[str, Any]:
    """The figures of one mode against serial (bounds: the module docstring)."""
    want_losses, want = serial
    loss_rel, (rtol, atol) = (1e-5, (1e-5, 1e-6)) if device == "cpu" else (1e-4, (1e-4, 1e-5))
    merged: dict[str, Tensor] = {}
    worst_loss = 0.0
    for losses, part, _ in results:
        for got, ref in zip(losses, want_losses, strict=True):
            worst_loss = max(worst_loss, abs(got - ref) / max(abs(ref), 1e-12))
        merged.update(part)
    missing = sorted(set(want) - set(merged))
    worst_weight = max(
        (float(((merged[n] - w).abs() - rtol * w.abs()).max()) for n, w in want.items() if n in merged),
        default=0.0,
    )
    ok = worst_loss <= loss_rel and not missing and worst_weight <= atol
    if device != "cpu" and "chunks" in results[0][2]:  # a device budget: some chunks live there
        ok = ok and results[0][2]["chunks"]["device"] > 0 and results[0][2]["chunks"]["host"] > 0
    return {
        "ok": ok,
        "loss_rel_diff": worst_loss,
        "loss_rel_bound": loss_rel,
        "weight_excess": worst_weight,
        "weight_bound": {"rtol": rtol, "atol": atol},
        "missing_weights": missing[:5],
        "losses": [round(x, 6) for x in want_losses],
        **results[0][2],
    }
