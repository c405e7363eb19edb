"""Single-rank overhead of the whole stack: Tessera's ``boost()`` / ``Engine.train_step`` at
world 1 (dp 1, ZeRO stage 0, fp32, gradient clipping at 1.0) beside plain PyTorch (system
"torch") on the same reference GPT, data and AdamW, in one process (one gloo rank, one
thread).

The plain step is what a user writes: forward, ``F.cross_entropy``, ``backward``,
``clip_grad_norm_(1.0)``, ``AdamW.step``, ``zero_grad``, ``loss.item()``. Tessera's is
``engine.train_step(idx, targets)`` (one microbatch), which does the same arithmetic through
the stack (flat parameter buffers, the gradient reducer, the global-norm clip, the loss
average over dp). Both start from the same weights and see the same batches; their losses
must agree (``loss_match``, rtol 1e-4: the flat AdamW and the clip sum in another order).

The systems alternate step by step (ABAB, so background load hits both alike).
``ratio_vs_peer`` on Tessera's line is torch's median step time over Tessera's (below 1:
Tessera is slower; the goal is at least 0.97), ``ratio_paired_median`` the median of the
back-to-back ratios. A token is one sequence position.

``--fused``: both sides use ``AdamW(fused=True)`` (one kernel per tensor; on the CPU, torch's
default AdamW runs about seven element-wise passes per tensor and allocates temporaries the
size of each tensor, which costs most on Tessera's flat buffers: one 21 MB tensor here).

``--breakdown``: ``--breakdown-steps`` more steps of each under torch.profiler: the split of
a step into compute / communication / idle / overhead (``benchmarks/_breakdown.py``), and
``ops_per_step`` (CPU op events per step, everything counted), a deterministic count of the
dispatch work each side does; the traces and a stacked-bar ``breakdown.png`` go into the run
folder (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _breakdown import STEP, Breakdown, add_breakdown_args, breakdown_folder, load_trace, plot, profile_steps
from _common import add_gpt_args, emit, gpt_config, table

from tessera.comm.testing import WorkerPool
from tessera.launcher import Config, boost
from tessera.launcher.config import OptimConfig, ParallelConfig, TrainConfig, ZeroConfig
from tessera.models import GPT, GPTConfig, make_batch
from tessera.zero import Precision

ADAMW = {"lr": 3e-4, "weight_decay": 0.1}
CLIP = 1.0
SYSTEMS = ("tessera", "torch")


def _systems(cfg: GPTConfig, batch: int, fused: bool) -> dict[str, Callable[[int], float]]:
    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, batch, seed=1000 + i)

    adamw: dict[str, Any] = {**ADAMW, "fused": True} if fused else dict(ADAMW)
    plain = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(plain.parameters(), **adamw)

    def torch_step(i: int) -> float:
        idx, targets = data(i)
        loss = F.cross_entropy(plain(idx).flatten(0, -2), targets.flatten())
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss.item()

    model = GPT(cfg, seed=0)
    config = Config(
        parallel=ParallelConfig(dp=1, microbatches=1),
        zero=ZeroConfig(stage=0),
        optim=OptimConfig(clip_grad_norm=CLIP),
        train=TrainConfig(precision=Precision.FP32),
    )
    engine = boost(model, torch.optim.AdamW(model.parameters(), **adamw), config)

    def tessera_step(i: int) -> float:
        return engine.train_step(*data(i)).loss

    return {"tessera": tessera_step, "torch": torch_step}


def _ops_per_step(trace: str) -> float:
    events = load_trace(trace)
    steps = [e for e in events if e.get("name") == STEP]
    main = steps[0]["tid"]
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main]
    return len(ops) / len(steps)


def _run(
    rank: int,
    cfg: GPTConfig,
    batch: int,
    warmup: int,
    iters: int,
    folder: str | None,
    prof_steps: int,
    fused: bool,
) -> dict[str, Any]:
    torch.manual_seed(0)
    steps = _systems(cfg, batch, fused)
    losses: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for i in range(warmup + iters):
        for name in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
            t0 = time.perf_counter()
            losses[name].append(steps[name](i))
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"times": times, "losses": losses}
    if folder is not None:
        n = warmup + iters
        for name in SYSTEMS:
            trace = f"{folder}/{name}-rank{rank}.json"
            b = profile_steps(functools.partial(steps[name], n), prof_steps, trace)
            out[name] = {
                "breakdown": b.as_record(),
                "breakdown_trace": trace,
                "ops_per_step": _ops_per_step(trace),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpt_args(parser, seq=128, batch=8, iters=20)
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True) on both sides")
    add_breakdown_args(parser, "overhead", "both systems")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = gpt_config(args)
    folder = breakdown_folder(args, "overhead")
    with WorkerPool(1, timeout=900) as pool:
        res = pool.run(
            _run, cfg, args.batch, args.warmup, args.iters, folder, args.breakdown_steps, args.fused
        )[0]
    psi = sum(p.numel() for p in GPT(cfg, seed=0).parameters())
    med = {s: statistics.median(res["times"][s]) for s in SYSTEMS}
    paired = statistics.median(
        b / a for a, b in zip(res["times"]["tessera"], res["times"]["torch"], strict=True)
    )
    final = {s: res["losses"][s][-1] for s in SYSTEMS}
    worst = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(*(res["losses"][s] for s in SYSTEMS), strict=True)
    )
    records: list[dict[str, Any]] = []
    for name in SYSTEMS:
        rec: dict[str, Any] = {
            "bench": "overhead",
            "system": name,
            "config": (
                f"world=1 gpt {psi / 1e6:.1f}M d={cfg.d_model} L={cfg.n_layers} V={cfg.vocab_size} "
                f"seq={cfg.seq_len} batch={args.batch} AdamW{'(fused)' * args.fused} clip={CLIP} fp32"
                + (" boost(dp=1, zero=0) Engine.train_step" if name == "tessera" else " plain loop")
            ),
            "step_time_s": round(med[name], 5),
            "tokens_per_s": round(args.batch * cfg.seq_len / med[name], 1),
            "final_loss": round(final[name], 6),
            "ratio_vs_peer": round(med["torch"] / med["tessera"], 4) if name == "tessera" else None,
            "ratio_paired_median": round(paired, 4) if name == "tessera" else None,
            "loss_match": worst <= 1e-4 if name == "tessera" else None,
            "max_loss_rel_diff": worst if name == "tessera" else None,
        }
        if name in res:
            rec |= res[name]
        records.append(rec)
    for rec in records:
        emit(rec)
    if folder is not None:
        bars = {
            r["system"]: Breakdown(**{k: v for k, v in r["breakdown"].items() if k != "fractions"})
            for r in records
        }
        plot(bars, f"{folder}/breakdown.png", "world 1: boost()/Engine vs plain PyTorch (torch.profiler)")
        with open(f"{folder}/results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    table(
        records,
        (
            "system",
            "step_time_s",
            "tokens_per_s",
            "ratio_vs_peer",
            "ratio_paired_median",
            "loss_match",
            "final_loss",
        ),
    )


if __name__ == "__main__":
    main()
