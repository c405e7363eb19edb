"""One process of ``bench lora``: a rank of a Tessera engine, the torch + peft process, or a rank
of DeepSpeed ZeRO-3 + peft; it trains ``_lora_model``'s model and prints one JSON line.

- ``tessera-lora`` / ``tessera-full``: ``boost(model, AdamW, config)`` of the PEFT model (only
  the adapters train) or of the bare model (every parameter trains) in ``--layout``
  (``dp2-zero3``: dp=2 with ZeRO stage 3; ``dp2-zero1``: stage 1, the base replicated;
  ``tp2``: 1D tensor parallelism; ``tp2-sp``: with Megatron sequence parallelism),
  ``train.precision`` bf16, gradients clipped at norm 1; each
  step the whole global batch is passed to ``Engine.train_step`` (each rank trains its rows).
  ``model_state_bytes``: ``Engine.zero.memory()`` from a step pre-hook of the optimizer on
  the last warm-up step (gradients and optimizer state present); ``comm_bytes``: what
  ``tessera.comm.CommMeter`` counts in that step (an all-reduce of S bytes counts 2S).
- ``torch-peft``: the same PEFT model in this one process, no process group: forward on the
  whole global batch, the cross-entropy of the logits in fp32, backward, gradient clipping at
  norm 1, ``torch.optim.AdamW`` over the adapters. ``model_state_bytes``:
  ``tessera.comm.measure_memory`` after the backward of the last warm-up step.
- ``deepspeed-peft``: ``deepspeed.initialize`` of the PEFT model with ZeRO stage 3, bf16,
  ``gradient_clipping`` 1 and ``torch.optim.AdamW`` over the adapters as the client
  optimizer, gloo (``DS_ACCELERATOR=cpu``), each rank on its rows of the global batch. It runs
  in DeepSpeed's own Python, which has no Tessera: this file imports Tessera only in the
  branches that use it. No ``model_state_bytes`` (DeepSpeed's partitions are not counted).

Every step trains on the same global batch (``_lora_model.batch(size, 0)``), so the loss falls
as the model learns it: the run shows that it trains.

Memory: glibc's mmap threshold is pinned at 128 KiB (``_common.malloc_for_rss``) from the
start through the warm-up, so freed tensors leave the resident set; ``base_rss_mb`` is the
resident set after the imports and the process group, before the model is built;
``phase_peak_rss_mb`` the resident peak (``VmHWM``, reset through /proc/self/clear_refs at
each phase's start) of each phase: ``imports`` (and the process group), ``build`` (the bf16
model, and PEFT's wrapping), ``wrap`` (``boost()``, ``deepspeed.initialize``, the optimizer),
``first_step`` and ``train`` (the other warm-up steps: optimizer state exists by then,
steady training; also ``train_peak_rss_mb``); ``peak_rss_mb`` is the largest of them. The
timed steps run after ``_common.malloc_for_speed`` (an ordinary process's heap), each after a
barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import malloc_for_rss, malloc_for_speed, status_kb
from _lora_model import LoraSize, batch, build, logits, total, trainable
from torch import nn

SYSTEMS = ("tessera-lora", "tessera-full", "torch-peft", "deepspeed-peft")
LAYOUTS = ("dp2-zero3", "dp2-zero1", "tp2", "tp2-sp")
CLIP = 1.0

Step = Callable[[int], float]  # runs step k, returns its loss


class Peaks:
    """The resident peak (``VmHWM``, MiB) of each phase of the run: ``mark(name)`` ends one."""

    def __init__(self) -> None:
        self.mib: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.mib[name] = round(status_kb("VmHWM") / 1024, 1)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (ru_maxrss too)


def _state(mem: Any) -> dict[str, Any]:
    """A ``tessera.comm.MemoryReport``'s model-state bytes, and their parts."""
    parts = {"parameters": mem.parameters, "gradients": mem.gradients, "optimizer_state": mem.optimizer_state}
    return {"model_state_bytes": mem.model_state, "state_bytes": parts}


def _tessera(
    args: argparse.Namespace, size: LoraSize, world: int, peaks: Peaks
) -> tuple[nn.Module, Step, Any]:
    """The boosted engine's step, and a callable giving the model-state report (see the doc)."""
    from tessera.comm import CommMeter
    from tessera.launcher import BoostConfig, OptimConfig, ParallelConfig, TrainConfig, ZeroConfig, boost
    from tessera.zero import Precision

    layouts = {
        "dp2-zero3": (ParallelConfig(dp=world, microbatches=1), 3),
        "dp2-zero1": (ParallelConfig(dp=world, microbatches=1), 1),
        "tp2": (ParallelConfig(tp=world, microbatches=1), 0),
        "tp2-sp": (ParallelConfig(tp=world, microbatches=1, sequence_parallel=True), 0),
    }
    parallel, stage = layouts[args.layout]
    config = BoostConfig(
        parallel=parallel,
        zero=ZeroConfig(stage=stage),
        optim=OptimConfig(lr=args.lr, clip_grad_norm=CLIP),
        train=TrainConfig(precision=Precision.BF16, seed=0),
    )
    model = build(size, lora=args.system == "tessera-lora")
    peaks.mark("build")
    counts = (trainable(model), total(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine = boost(model, opt, config)
    report: dict[str, Any] = {}

    def record(*_: object) -> None:
        if report.get("armed"):
            mem = engine.zero.memory()
            report.update(_state(mem), armed=False)

    engine.optimizer.register_step_pre_hook(record)

    def step(k: int) -> float:
        report["armed"] = k == args.warmup - 1
        if k != args.warmup - 1:
            return engine.train_step(*batch(size, 0)).loss
        with CommMeter() as meter:
            loss = engine.train_step(*batch(size, 0)).loss
        report["comm_bytes"] = meter.volume_bytes
        return loss

    return model, step, (counts, report, engine)


def _torch_peft(args: argparse.Namespace, size: LoraSize, peaks: Peaks) -> tuple[nn.Module, Step, Any]:
    from tessera.comm import measure_memory

    model = build(size, lora=True)
    peaks.mark("build")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    report: dict[str, Any] = {}

    def step(k: int) -> float:
        ids, targets = batch(size, 0)
        loss = F.cross_entropy(logits(model(input_ids=ids)).float().flatten(0, 1), targets.flatten())
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        if k == args.warmup - 1:
            report.update(_state(measure_memory(modules=[model], optimizers=[opt])))
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return model, step, ((trainable(model), total(model)), report, None)


def _deepspeed(
    args: argparse.Namespace, size: LoraSize, rank: int, world: int, peaks: Peaks
) -> tuple[nn.Module, Step, Any]:
    import deepspeed  # type: ignore[import-not-found, unused-ignore]

    model = build(size, lora=True)
    peaks.mark("build")
    counts = (trainable(model), total(model))
    rows = slice(rank * size.rows // world, (rank + 1) * size.rows // world)
    conf = {
        "train_micro_batch_size_per_gpu": size.rows // world,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "gradient_clipping": CLIP,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**30,
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf)

    def step(k: int) -> float:
        ids, targets = batch(size, 0)
        out = logits(engine(input_ids=ids[rows]))
        loss = F.cross_entropy(out.float().flatten(0, 1), targets[rows].flatten())
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1).float()
        dist.all_reduce(mean)
        return float(mean) / world

    return model, step, (counts, {}, None)


def child(args: argparse.Namespace) -> None:
    """Build, warm up, time; print this rank's JSON line (see the module doc)."""
    malloc_for_rss()
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    size = LoraSize(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        ffn=args.ffn, rank=args.lora_rank, alpha=args.lora_alpha, seq=args.seq, rows=args.rows,
    )  # fmt: skip
    if args.system == "deepspeed-peft":
        from _memory_peers import deepspeed_gloo

        deepspeed_gloo(args.store, rank, world)
    elif world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
        import tessera.launcher.train.boost  # before the baseline, as the peers import theirs
    else:
        import tessera.comm  # noqa: F401
    import peft  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    import transformers  # type: ignore[import-not-found, unused-ignore]  # noqa: F401

    base = status_kb("VmRSS")
    peaks = Peaks()
    peaks.mark("imports")
    t0 = time.perf_counter()
    if args.system == "torch-peft":
        _, step, extra = _torch_peft(args, size, peaks)
    elif args.system == "deepspeed-peft":
        _, step, extra = _deepspeed(args, size, rank, world, peaks)
    else:
        _, step, extra = _tessera(args, size, world, peaks)
    (train, params), report, engine = extra
    setup_s = time.perf_counter() - t0
    peaks.mark("wrap")
    losses: list[float] = []
    for k in range(args.warmup):
        losses.append(step(k))
        if k == 0:
            peaks.mark("first_step")
    peaks.mark("train")
    malloc_for_speed()
    times = []
    for k in range(args.warmup, args.warmup + args.iters):
        if world > 1:
            dist.barrier()
        t1 = time.perf_counter()
        losses.append(step(k))
        times.append(time.perf_counter() - t1)
    if engine is not None:
        engine.close()
    report.pop("armed", None)
    out = {
        "rank": rank,
        "trainable_params": train,
        "params": params,
        "step_time_s": statistics.median(times),
        "step_times": [round(t, 4) for t in times],
        "losses": [round(v, 5) for v in losses],
        "setup_s": round(setup_s, 2),
        "base_rss_mb": round(base / 1024, 1),
        "peak_rss_mb": max(peaks.mib.values()),
        "train_peak_rss_mb": peaks.mib["train"],
        "phase_peak_rss_mb": peaks.mib,
        **report,
    }
    print(json.dumps(out), flush=True)
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def add_size_args(parser: argparse.ArgumentParser) -> None:
    """The model, adapter and batch options (``LoraSize``'s defaults) the parent and child share."""
    d = LoraSize()
    for key, default in (
        ("vocab", d.vocab), ("dim", d.dim), ("layers", d.layers), ("heads", d.heads),
        ("kv-heads", d.kv_heads), ("ffn", d.ffn), ("lora-rank", d.rank), ("lora-alpha", d.alpha),
        ("seq", d.seq), ("rows", d.rows),
    ):  # fmt: skip
        parser.add_argument(f"--{key}", type=int, default=default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--layout", choices=LAYOUTS, default="dp2-zero3")
    add_size_args(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--store", default="")
    child(parser.parse_args())


if __name__ == "__main__":
    main()
