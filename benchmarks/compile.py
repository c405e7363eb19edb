"""``train.compile``: compile time and the step time of the compiled model beside the same
model eager, per mode, on the reference GPT (d=256, 8 heads, 4 layers, V=4096, seq 128,
batch 8 by default), AdamW, fp32, through ``boost()`` / ``Engine.train_step``.

Modes (``--modes``): ``serial`` (world 1, dp 1, ZeRO 0), ``dp2-zero1``, ``dp2-zero3``,
``tp2`` (1D) and ``pp2-1f1b`` on a worker pool of their world size; ``--microbatches``
(default 1, pp2: 2) splits each rank's batch into that many microbatches (accumulated, or
the pipeline's). In each mode both systems (``eager`` and ``compiled``) are built in the
same ranks from the same weights and fed the same batches, and step alternately (ABAB, so
background load hits both alike).
The inductor caches start empty (a fresh ``TORCHINDUCTOR_CACHE_DIR`` per run, and a reset
dynamo in each rank), so ``first_step_s`` of the compiled line is a cold compile of the
layers' forward and backward plus one step; ``compile_s`` is that less the compiled median
step. ``ratio_vs_peer`` on the compiled line: eager median step time over compiled (above
1: compiled is faster); ``loss_match``: every step's loss within rel 1e-5 of eager's (the
compiled kernels sum in another order). In the serial mode the same per-layer compile runs
on plain PyTorch too (``torch-eager``, ``torch-compiled``: the GPT's plain loop, fused AdamW,
clip 1.0), in the same rotation, so the two ratios tell the compiler's gain on this machine
from what Tessera's wrapping adds; the compiled code of the shared layer class may be reused
between the two compiled systems (the plain line reports no ``compile_s``). A token is one
sequence position.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import add_gpt_args, emit, gpt_config, table
from torch import Tensor

from tessera.comm.testing import WorkerPool
from tessera.launcher import Config, Engine, boost
from tessera.launcher.config import OptimConfig, ParallelConfig, TrainConfig, ZeroConfig
from tessera.models import GPT, GPTConfig, make_batch
from tessera.zero import Precision

SYSTEMS = ("eager", "compiled")
PLAIN = ("torch-eager", "torch-compiled")  # serial only: the same compile without Tessera
MODES: dict[str, tuple[ParallelConfig, int]] = {
    "serial": (ParallelConfig(microbatches=1), 0),
    "dp2-zero1": (ParallelConfig(dp=2, microbatches=1), 1),
    "dp2-zero3": (ParallelConfig(dp=2, microbatches=1), 3),
    "tp2": (ParallelConfig(tp=2, microbatches=1), 0),
    "pp2-1f1b": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 0),
}


def _engine_step(engine: Engine, idx: Tensor, targets: Tensor) -> float:
    return engine.train_step(idx, targets).loss


def _plain_step(cfg: GPTConfig, *, compiled: bool) -> Callable[[Tensor, Tensor], float]:
    """A plain PyTorch step of the reference GPT: forward, cross-entropy, backward, clip 1.0,
    fused AdamW (what boost() rebuilds a default AdamW into); ``compiled``: each layer's
    forward under torch.compile, as ``train.compile`` does."""
    model = GPT(cfg, seed=0)
    if compiled:
        for layer in model.layers:
            layer.forward = torch.compile(layer.forward, options={"fallback_random": True})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)

    def step(idx: Tensor, targets: Tensor) -> float:
        loss = F.cross_entropy(model(idx).flatten(0, -2), targets.flatten())
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    return step


def _run(
    rank: int, cfg: GPTConfig, mode: str, batch: int, microbatches: int, warmup: int, iters: int, cache: str
) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # empty: the compile is cold
    torch._dynamo.reset()
    counters.clear()
    parallel, stage = MODES[mode]
    if microbatches:
        parallel = dataclasses.replace(parallel, microbatches=microbatches)
    base = Config(
        parallel=parallel,
        zero=ZeroConfig(stage=stage),
        optim=OptimConfig(clip_grad_norm=1.0),
        train=TrainConfig(precision=Precision.FP32),
    )
    config = dataclasses.replace(base, data=dataclasses.replace(base.data, batch_size=batch))
    engines = {}
    for name in SYSTEMS:
        model = GPT(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        engines[name] = boost(model, opt, config, compile=name == "compiled")
    steps: dict[str, Callable[[Tensor, Tensor], float]] = {
        name: functools.partial(_engine_step, engine) for name, engine in engines.items()
    }
    if mode == "serial":  # the same per-layer compile on plain PyTorch, without Tessera
        for name in PLAIN:
            steps[name] = _plain_step(cfg, compiled=name == "torch-compiled")
    times: dict[str, list[float]] = {s: [] for s in steps}
    losses: dict[str, list[float]] = {s: [] for s in steps}
    order = list(steps)
    for i in range(warmup + iters):
        idx, targets = make_batch(cfg, batch, seed=1000 + i)
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            losses[name].append(steps[name](idx, targets))
            times[name].append(time.perf_counter() - t0)
    graphs = int(counters["stats"]["unique_graphs"])
    for engine in engines.values():
        engine.mesh.close()
    torch._dynamo.reset()
    return {"times": times, "losses": losses, "graphs": graphs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpt_args(parser, seq=128, batch=8, iters=10)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--microbatches", type=int, default=0, help="per step (0: 1, pp2: 2)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = gpt_config(args)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    psi = sum(p.numel() for p in GPT(cfg, seed=0).parameters())
    records: list[dict[str, Any]] = []
    for mode in modes:
        world = MODES[mode][0].topology().world_size
        with (
            tempfile.TemporaryDirectory(prefix="tessera-inductor-") as cache,
            WorkerPool(world, timeout=1800) as pool,
        ):
            res = pool.run(_run, cfg, mode, args.batch, args.microbatches, args.warmup, args.iters, cache)[0]
        med = {s: statistics.median(t[args.warmup :]) for s, t in res["times"].items()}
        pairs = [SYSTEMS, PLAIN] if PLAIN[0] in med else [SYSTEMS]
        for eager, compiled in pairs:
            worst = max(
                abs(a - b) / max(abs(b), 1e-12)
                for a, b in zip(res["losses"][compiled], res["losses"][eager], strict=True)
            )
            for name in (eager, compiled):
                is_compiled = name == compiled
                first = res["times"][name][0]
                how = "boost() Engine.train_step" if name in SYSTEMS else "plain loop, fused AdamW"
                records.append(
                    {
                        "bench": "compile",
                        "system": name,
                        "config": (
                            f"{mode} gpt {psi / 1e6:.1f}M d={cfg.d_model} L={cfg.n_layers} "
                            f"V={cfg.vocab_size} seq={cfg.seq_len} batch={args.batch} "
                            f"microbatches={args.microbatches or MODES[mode][0].microbatches} "
                            f"AdamW fp32 {how}"
                        ),
                        "mode": mode,
                        "step_time_s": round(med[name], 5),
                        "tokens_per_s": round(args.batch * cfg.seq_len / med[name], 1),
                        "final_loss": round(res["losses"][name][-1], 6),
                        "first_step_s": round(first, 3),
                        # the plain compiled line reuses the layers' compiled code: no compile of its own
                        "compile_s": round(first - med[name], 3) if is_compiled and name in SYSTEMS else None,
                        "graphs": res["graphs"] if is_compiled and name in SYSTEMS else None,
                        "ratio_vs_peer": round(med[eager] / med[compiled], 4) if is_compiled else None,
                        "loss_match": worst <= 1e-5 if is_compiled else None,
                        "max_loss_rel_diff": worst if is_compiled else None,
                    }
                )
                emit(records[-1])
    table(
        records,
        (
            "mode",
            "system",
            "step_time_s",
            "tokens_per_s",
            "first_step_s",
            "compile_s",
            "ratio_vs_peer",
            "loss_match",
        ),
    )


if __name__ == "__main__":
    main()
