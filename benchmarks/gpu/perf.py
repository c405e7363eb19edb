"""The device checks that report figures: the CUDA attention kernels against the unfused
path, communication overlapped by compute in a profiler trace, and a Llama-style model's MFU.
Each is a rank function for `gpu.ranks.run_ranks`."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gpu.modes import ROLES, Sizes, batch_of, config_of, model_of, optimizer_of
from tessera.launcher import Config, ParallelConfig, TrainConfig, boost
from tessera.models import ForeignConfig, Llamaish
from tessera.zero.precisions import Precision

__all__ = ["PEAK_BF16_FLOPS", "kernel_check", "mfu_run", "overlap_fraction", "overlap_run"]

# Dense bf16 tensor-core peak by device name, FLOP/s. NVIDIA's H100 / H200 SXM datasheets give
# 1,979 TFLOPS for bf16 "with sparsity" (2:4 structured), so 989.4 dense; the NVL (PCIe) H200
# 1,671 with sparsity, 835.5 dense. Only devices named here get an MFU.
PEAK_BF16_FLOPS = {"H200 NVL": 835.5e12, "H200": 989.4e12, "H100 NVL": 835.5e12, "H100": 989.4e12}

# ---------------------------------------------------------------- the CUDA attention kernels
# Tolerances of a fused kernel against the unfused operators, on the largest difference over
# the largest magnitude of the reference (outputs and gradients scale with the block): fp32
# 2e-3, as the CUDA memory-efficient kernel may multiply in TF32 (10 mantissa bits: ~1e-3
# relative); bf16 (CUDA flash, CPU flash), against the unfused path in fp32 on the same bf16
# inputs, 4e-2: the kernels keep the probabilities in bf16 for the second product (8 mantissa
# bits: ~4e-3 per element, summed over keys). A wrong scale, mask or log-sum-exp is off by
# O(0.1) of the largest magnitude.
KERNEL_TOL = {torch.float32: 2e-3, torch.bfloat16: 4e-2}


def kernel_check(rank: int, size: str, device: str) -> list[dict[str, Any]]:
    """Fused against unfused on ``device`` (CUDA: the flash and memory-efficient kernels; the
    CPU: its flash kernel), forward (out, lse) and backward (dq, dk, dv from a final output
    and log-sum-exp as after merging another block of about the same mass), causal and not,
    in fp32 and bf16."""
    from tessera.tensor_parallel.context import kernels

    rows = 2048 if size == "full" else 32
    out: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    scale = 1 / math.sqrt(64)
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            q, k, v, dout, final = (
                torch.randn(2, 4, rows, 64, device=device, generator=gen) for _ in range(5)
            )
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            q32, k32, v32 = (t.float() for t in (qd, kd, vd))  # the same (rounded) inputs
            own = kernels.block_forward(q32, k32, v32, None, causal, scale, which="unfused")[1]
            lse = own + math.log(2.0)  # another block of the same mass merged in
            delta = (dout * final).sum(-1, keepdim=True)
            chosen = kernels.kernel(qd, None)
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fused = (
                *kernels.block_forward(qd, kd, vd, None, causal, scale),
                *kernels.block_backward(qd, kd, vd, final, lse, dout, delta, None, causal, scale),
            )
            if device != "cpu":
                torch.cuda.synchronize()
            fused_s = time.perf_counter() - t0
            plain = (
                *kernels.block_forward(q32, k32, v32, None, causal, scale, which="unfused"),
                *kernels.block_backward(
                    q32, k32, v32, final, lse, dout, delta, None, causal, scale, which="unfused"
                ),
            )
            errors = {
                name: float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-12))
                for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), fused, plain, strict=True)
            }
            tol = KERNEL_TOL[dtype]
            out.append({
                "dtype": str(dtype).removeprefix("torch."), "causal": causal, "rows": rows,
                "kernel": chosen, "max_diff_over_max": errors, "tolerance": tol,
                "ok": chosen != "unfused" and all(e <= tol for e in errors.values()),
                "fused_s": round(fused_s, 6),
            })  # fmt: skip
    return out


# ---------------------------------------------------------------- overlap in a profiler trace
_COMPUTE_CPU = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}  # fmt: skip


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in spans)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_fraction(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the time some collective is in flight (a ``tessera.comm.*`` range, a gloo/NCCL
    collective range, an NCCL kernel), the share during which compute runs too. Compute: GPU
    kernels other than NCCL's where the trace has any, else the CPU's matrix products and
    attention kernels, on a thread and at a time no collective range of that thread covers
    (a collective's own copies are not compute). Times in seconds."""
    from _breakdown import _is_collective

    comm: list[tuple[float, float]] = []
    by_tid: dict[Any, list[tuple[float, float]]] = {}
    kernels_gpu: list[tuple[float, float]] = []
    cpu_ops: list[tuple[dict[str, Any], tuple[float, float]]] = []
    for ev in events:
        name, lo = str(ev.get("name", "")), float(ev["ts"])
        span = (lo, lo + float(ev.get("dur", 0.0)))
        if ev.get("cat") == "kernel":
            (comm if "nccl" in name.lower() else kernels_gpu).append(span)
        elif _is_collective(name):
            comm.append(span)
            by_tid.setdefault((ev.get("pid"), ev.get("tid")), []).append(span)
        elif ev.get("cat") == "cpu_op" and name in _COMPUTE_CPU:
            cpu_ops.append((ev, span))
    if kernels_gpu:
        compute = kernels_gpu
    else:

        def inside_comm(ev: dict[str, Any], span: tuple[float, float]) -> bool:
            own = by_tid.get((ev.get("pid"), ev.get("tid")), [])
            return any(lo <= span[0] and span[1] <= hi for lo, hi in own)

        compute = [span for ev, span in cpu_ops if not inside_comm(ev, span)]
    c, k = _union(comm), _union(compute)
    comm_s, both = _length(c) / 1e6, _intersect(c, k) / 1e6
    return {
        "communication_s": round(comm_s, 6),
        "compute_s": round(_length(k) / 1e6, 6),
        "overlapped_s": round(both, 6),
        "overlap_fraction": round(both / comm_s, 4) if comm_s > 0 else 0.0,
        "compute_source": "gpu kernels" if kernels_gpu else "cpu ops",
    }


def overlap_run(rank: int, mode: str, s: Sizes, device: str, out_dir: str, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``mode`` under torch.profiler after one warm-up step; every rank
    writes its trace, rank 0's overlap is returned."""
    from _breakdown import load_trace, profile_steps

    model = model_of(s, device)
    engine = boost(model, optimizer_of(model), config_of(mode, s), plan=ROLES)
    batch = batch_of(s, 0)
    engine.train_step(*batch)

    def step() -> None:
        engine.train_step(*batch)
        if device != "cpu":
            torch.cuda.synchronize()

    trace = Path(out_dir) / f"overlap-{mode}-rank{rank}.json"
    profile_steps(step, steps, trace)
    engine.mesh.close()
    return {"trace": str(trace), **overlap_fraction(load_trace(trace))}


# ---------------------------------------------------------------- MFU of a Llama-style model
def mfu_model(size: str) -> tuple[ForeignConfig, int, int]:
    """The model, sequence length and batch: ~1B parameters at seq 2048 (``full``), or a
    model of a few thousand parameters (``tiny``)."""
    if size == "tiny":
        return ForeignConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, hidden=64, max_len=32), 32, 2
    return (
        ForeignConfig(vocab=32000, dim=2048, heads=16, kv_heads=8, layers=18, hidden=5632, max_len=2048),
        2048,
        8,
    )


def mfu_run(rank: int, size: str, device: str, steps: int) -> dict[str, Any]:
    """Forward + backward + optimizer step through ``boost()`` (bf16, AdamW, world 1): the
    median step time, tokens/s, model FLOPs per step and MFU against the device's peak.
    FLOPs per token: 6 N (N: the parameters but the token embedding, a lookup) plus attention's
    12 x layers x dim x seq (QK^T and PV, forward and backward, causal counted whole, as
    PaLM's appendix counts them)."""
    c, seq, batch = mfu_model(size)
    model = Llamaish(c, seed=0).to(device)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings"))
    base = Config(parallel=ParallelConfig(microbatches=1), train=TrainConfig(precision=Precision.BF16))
    config = dataclasses.replace(base, data=dataclasses.replace(base.data, batch_size=batch))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = boost(model, opt, config, plan=ROLES)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, c.vocab, (batch, seq + 1), generator=gen)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times, losses = [], []
    for i in range(steps + 2):  # two warm-up steps
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(engine.train_step(ids, targets).loss)
        if device != "cpu":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = (6 * n + 12 * c.layers * c.dim * seq) * batch * seq
    name = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    engine.mesh.close()
    return {
        "params": sum(p.numel() for p in model.parameters()), "params_counted": n,
        "seq": seq, "batch": batch, "step_time_s": round(step_s, 5),
        "tokens_per_s": round(batch * seq / step_s, 1), "model_flops_per_step": flops,
        "achieved_tflops": round(flops / step_s / 1e12, 3), "device_name": name,
        "peak_bf16_tflops": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else round(flops / step_s / peak, 4),
        "losses": [round(x, 4) for x in losses], "finite": all(math.isfinite(x) for x in losses),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device != "cpu" else None,
    }  # fmt: skip
