"""Measure the model-state bytes per rank of a 90%-frozen model in bf16 at ZeRO-3 over 2 ranks.

Run ``python packages/zero/tests/frozen_memory.py``; to measure another version of
tessera-zero (say, before frozen FlatParams dropped their fp32 masters), put its ``src`` first
on ``PYTHONPATH``. Ten 1024x1024 linear layers (10.5M parameters), the first nine frozen, as
a fine-tuning run freezes a backbone; AdamW; ranks as threads. One step, then rank 0's
``memory()`` (parameters, gradients, optimizer state, by storage) for the flat optimizer and
with offload, and its chunk report with ``memory=ChunkConfig()`` (host tier), one JSON line
each. A figure is printed, nothing asserted (the exact counts are asserted by
``test_zero_frozen.py`` on a small model).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm.testing import run_threaded
from tessera.zero import ChunkConfig, ZeroOptimizer

LAYERS, FROZEN, WIDTH, WORLD = 10, 9, 1024, 2


def measure(rank: int, mode: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * WIDTH**-0.5)
    model[:FROZEN].requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    try:
        zero = ZeroOptimizer(
            model,
            torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
            stage=3,
            group=None,
            precision="bf16",
            offload=mode == "offload",
            memory=ChunkConfig() if mode == "chunks" else None,
        )
    except ValueError as exc:
        return {"mode": mode, "refused": str(exc)}
    x = torch.randn(4, WIDTH, generator=gen).to(torch.bfloat16)
    zero.backward(F.mse_loss(model(x), torch.zeros_like(x)))
    assert zero.step()
    report = zero.memory()
    out: dict[str, Any] = {
        "mode": mode,
        "parameters": params,
        "frozen": frozen,
        "bytes": {
            "parameters": report.parameters,
            "gradients": report.gradients,
            "optimizer_state": report.optimizer_state,
            "model_state": report.model_state,
        },
    }
    chunks = zero.chunk_report()
    if chunks is not None:
        out["chunk_bytes"] = {
            "held": sum(chunks["resident_bytes"].values()),
            "placed": chunks["host"]["bytes"],
        }
        out["bytes"]["model_state_with_chunks"] = report.model_state + out["chunk_bytes"]["held"]
    zero.close()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    for mode in ("flat", "offload", "chunks"):
        print(json.dumps(run_threaded(WORLD, measure, mode)[0]))
