"""Heterogeneous memory: the largest reference GPT that trains under a resident-memory cap
with Tessera ZeRO-3 alone, with CPU offload (``offload=True``) and with the chunk memory
manager's disk tier (``memory=ChunkConfig(host_budget_mb=..., disk_dir=...)``), one rank,
AdamW, fp32; then the step time of the three at one size all of them train, and the disk
tier's bytes read and written per step beside the formula.

- Every measurement is a fresh process (``python memory.py --child ...``), so its peak
  resident set (``VmHWM``) is its own: ``peak_rss_mb`` covers the whole run, construction
  included (the full model is built before sharding: there is no meta-device init), and
  ``train_peak_rss_mb`` the steps after the first (VmHWM reset through /proc/self/clear_refs).
  glibc's mmap threshold is pinned (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the
  resident set.
- Sizes: ``--layers`` blocks of width ``--widths`` (ascending); a system's ladder stops at
  the first size whose peak exceeds ``--cap-mib`` (or that fails). ``largest_params`` is
  the largest size under the cap.
- Disk formula (stage 3, fp32, Adam): per step and element of the disk chunks, written 16
  bytes (gradient, master, two Adam moments), read 24 (the master for the forward and the
  backward gathers, then master, gradient and moments for the step; the first step reads no
  moments). ``disk_*_per_step`` are the steady-state steps' averages.
- Peers: DeepSpeed (ZeRO-Infinity) is not installed in this environment; FSDP2 with
  ``CPUOffloadPolicy`` was not attempted (see README).
- A token is one position of one sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SYSTEMS = ("zero3", "offload", "disk")


def child(args: argparse.Namespace) -> None:
    """Build, train ``--steps`` steps, print one JSON line of figures."""
    import torch

    from tessera.comm.testing import run_threaded
    from tessera.models import GPT, GPTConfig, make_batch
    from tessera.zero import ChunkConfig, ZeroOptimizer
    from tessera.zero.chunks.tracer import reset_peak_rss, rss_bytes

    torch.set_num_threads(1)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_heads=8, n_layers=args.layers
    )

    def body(rank: int) -> dict[str, Any]:
        model = GPT(cfg, seed=0)
        numel = sum(p.numel() for p in model.parameters())
        memory = None
        if args.system == "disk":
            memory = ChunkConfig(host_budget_mb=args.host_budget_mib, disk_dir=args.disk_dir)
        zero = ZeroOptimizer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            stage=3,
            offload=args.system == "offload",
            memory=memory,
        )
        times, losses = [], []
        disk0 = (0, 0)
        for step in range(args.steps):
            if step == 1:
                reset_peak_rss()
                if zero._chunks is not None:
                    r = zero._chunks.report()
                    disk0 = (r["disk_read"], r["disk_written"])
            idx, tgt = make_batch(cfg, args.batch, seed=step)
            t0 = time.perf_counter()
            loss = model.loss(idx, tgt)
            zero.backward(loss)
            zero.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        out: dict[str, Any] = {
            "params": numel,
            "step_time_s": statistics.median(times[1:]),
            "train_peak_rss_mb": rss_bytes()[1] / 2**20,
            "final_loss": losses[-1],
        }
        if zero._chunks is not None:
            r = zero._chunks.report()
            n = r["disk"]["bytes"] // r["bytes_per_element"]
            k = args.steps - 1
            out |= {
                "disk_read_per_step": (r["disk_read"] - disk0[0]) / k,
                "disk_written_per_step": (r["disk_written"] - disk0[1]) / k,
                "formula_read_per_step": 24 * n,
                "formula_written_per_step": 16 * n,
                "host_chunk_mb": r["host"]["bytes"] / 2**20,
                "disk_chunk_mb": r["disk"]["bytes"] / 2**20,
                "non_model_mb": r["non_model_bytes"]["host"] / 2**20,
            }
            zero._chunks.close()
        return out

    (res,) = run_threaded(1, body)
    res["peak_rss_mb"] = _hwm_total()
    print(json.dumps(res))


def _hwm_total() -> float:
    """The whole process's peak: ``ru_maxrss`` is not reset by clear_refs."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_one(args: argparse.Namespace, system: str, width: int, disk_dir: str) -> dict[str, Any] | None:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--system",
        system,
        "--width",
        str(width),
        "--disk-dir",
        disk_dir,
    ]
    for key in ("layers", "vocab", "seq", "batch", "steps", "host_budget_mib"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        print(f"{system} width {width} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, default="zero3", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--disk-dir", default=None, help="where the disk tier writes (default: a temp dir)")
    parser.add_argument("--cap-mib", type=float, default=1024.0, help="resident-memory cap per rank")
    parser.add_argument("--host-budget-mib", type=float, default=64.0, help="the disk system's host budget")
    parser.add_argument("--widths", default="256,512,768,1024,1280", help="model widths, ascending")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from _common import emit, table

    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="tessera-bench-memory-")
    widths = [int(w) for w in args.widths.split(",")]
    results: dict[tuple[str, int], dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    for system in SYSTEMS:
        for width in widths:
            res = run_one(args, system, width, disk_dir)
            if res is None:
                break
            results[(system, width)] = res
            fits = res["peak_rss_mb"] <= args.cap_mib
            record = {
                "bench": "memory",
                "system": f"tessera-{system}",
                "config": f"gpt d={width} L={args.layers} V={args.vocab} seq={args.seq} b={args.batch} adamw",
                "step_time_s": round(res["step_time_s"], 4),
                "tokens_per_s": round(args.batch * args.seq / res["step_time_s"], 1),
                "peak_rss_mb": round(res["peak_rss_mb"], 1),
                "model_state_bytes": 16 * res["params"],
                "final_loss": round(res["final_loss"], 4),
                "params": res["params"],
                "fits_cap": fits,
                "cap_mib": args.cap_mib,
                **{
                    k: (round(v, 1) if isinstance(v, float) else v)
                    for k, v in res.items()
                    if k not in ("step_time_s", "peak_rss_mb", "final_loss", "params")
                },
            }
            emit(record)
            records.append(record)
            if not fits:
                break
    for system in SYSTEMS:
        under = [r for r in records if r["system"] == f"tessera-{system}" and r["fits_cap"]]
        largest = max((r["params"] for r in under), default=0)
        emit(
            {
                "bench": "memory",
                "system": f"tessera-{system}",
                "config": f"largest under {args.cap_mib:g} MiB",
                "step_time_s": 0.0,
                "tokens_per_s": 0.0,
                "largest_params": largest,
            }
        )
    table(
        records,
        (
            "system",
            "params",
            "peak_rss_mb",
            "train_peak_rss_mb",
            "step_time_s",
            "fits_cap",
            "disk_read_per_step",
            "formula_read_per_step",
            "disk_written_per_step",
            "formula_written_per_step",
        ),
    )


if __name__ == "__main__":
    main()
