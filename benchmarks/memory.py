"""Heterogeneous memory: the largest reference GPT that trains under a resident-memory cap
with Tessera ZeRO-3 alone, with CPU offload (``offload=True``) and with the chunk memory
manager's disk tier (``memory=ChunkConfig(host_budget_mb=..., disk_dir=...)``), beside FSDP2
with CPU offload and DeepSpeed ZeRO-3 with NVMe or CPU offload; one rank, AdamW, fp32; then
the step time of all of them at one size they all train, and the disk tiers' bytes read and
written per step (Tessera's beside the formula).

- Every measurement is a fresh process (``python memory.py --child ...``), so its peak
  resident set (``VmHWM``) is its own: ``peak_rss_mb`` covers the whole run, construction
  included (the full model is built before sharding: there is no meta-device init), and
  ``train_peak_rss_mb`` the steps after the first (VmHWM reset through /proc/self/clear_refs).
  Resetting VmHWM resets ``ru_maxrss`` too (Linux keeps one high-water mark), and the chunk
  manager's tracer resets it in its warm-up step, so ``peak_rss_mb`` is the largest of
  VmHWM read after construction, before the reset at step 1, and at the end.
  glibc's mmap threshold is pinned (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the
  resident set.
- Sizes: ``--layers`` blocks of width ``--widths`` (ascending); a system's ladder stops at
  the first size whose peak exceeds ``--cap-mib`` (or that fails). ``largest_params`` is
  the largest size under the cap.
- Disk formula (stage 3, fp32, Adam): per step and element of the disk chunks, written 16
  bytes (gradient, master, two Adam moments), read 24 (the master for the forward and the
  backward gathers, then master, gradient and moments for the step; the first step reads no
  moments). ``disk_*_per_step`` are the steady-state steps' averages.
- Peers (``_memory_peers.py``), each a fresh one-rank process like Tessera's: FSDP2 with
  ``CPUOffloadPolicy`` (``torch-fsdp2-offload``), DeepSpeed ZeRO-3 with parameters and
  optimizer state offloaded to NVMe (``deepspeed-nvme``, ZeRO-Infinity) or to the host
  (``deepspeed-cpu``), run by ``--deepspeed-python`` (a separate venv; never a dependency
  here). A peer that cannot run gives a line with ``error`` or ``ladder_ended``
  ("not available: ..." or the failure's last line), never a failed bench; the "largest
  under" lines say what each system needed (``needs``).
- (b) step time: every system that ran, at each of ``--time-widths`` (default: the largest width all
  of them trained under the cap, else the smallest they all trained), ``--rounds`` fresh
  processes each, the order rotated each round; the median of the timed steps, and
  ``time_ratio_vs_tessera_zero3`` (above 1: slower than Tessera ZeRO-3 alone).
- A token is one position of one sequence.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import emit, table
from _memory_peers import PEERS, deepspeed_version, peer_command
from peers import peer_python

SYSTEMS = ("zero3", "offload", "disk")
ALL = (*SYSTEMS, *PEERS)
NAMES = {
    "zero3": "tessera-zero3",
    "offload": "tessera-offload",
    "disk": "tessera-disk",
    "fsdp2-offload": "torch-fsdp2-offload",
    "deepspeed-nvme": "deepspeed-nvme",
    "deepspeed-cpu": "deepspeed-cpu",
}
NEEDS = {
    "zero3": "torch and the Tessera packages (the hatch env)",
    "offload": "torch and the Tessera packages (the hatch env)",
    "disk": "torch and the Tessera packages (the hatch env); a directory",
    "fsdp2-offload": "torch only (fully_shard, CPUOffloadPolicy); a one-rank gloo group",
    "deepspeed-nvme": (
        "a venv with deepspeed and the same torch; DS_ACCELERATOR=cpu (gloo without oneCCL); ninja and a "
        "C++ compiler for the JIT ops async_io and cpu_adam; libaio-dev (apt) for async_io; a directory"
    ),
    "deepspeed-cpu": (
        "a venv with deepspeed and the same torch; DS_ACCELERATOR=cpu (gloo without oneCCL); ninja and a "
        "C++ compiler for the JIT op cpu_adam"
    ),
}
logger = logging.getLogger("bench.memory")


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
        hwm = [rss_bytes()[1]]  # VmHWM: built (see the module doc)
        for step in range(args.steps):
            if step == 1:
                hwm.append(rss_bytes()[1])  # through the first step
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
            "step_times": times[1:],
            "train_peak_rss_mb": rss_bytes()[1] / 2**20,
            "peak_rss_mb": max(*hwm, rss_bytes()[1]) / 2**20,
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

    (res,) = run_threaded(1, body, timeout=args.timeout)
    print(json.dumps(res))


def run_one(
    args: argparse.Namespace, system: str, width: int, disk_dir: str, steps: int
) -> dict[str, Any] | str:
    """One measurement in a fresh process: its JSON figures, or a line saying why there are none."""
    extra: dict[str, str] = {}
    if system in SYSTEMS:
        cmd = [sys.executable, __file__, "--child"]
    else:
        got = peer_command(system, args.deepspeed_python)
        if isinstance(got, str):
            return got
        cmd, extra = got
    run_dir = tempfile.mkdtemp(prefix=f"{system}-d{width}-", dir=disk_dir)
    cmd += ["--system", system, "--width", str(width), "--disk-dir", run_dir, "--steps", str(steps)]
    for key in ("layers", "vocab", "seq", "batch"):
        cmd += [f"--{key}", str(getattr(args, key))]
    if system == "disk":
        cmd += ["--host-budget-mib", str(args.host_budget_mib)]
    env = {**os.environ, **extra, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"failed: timed out after {args.timeout:g} s"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no stderr)"]
        return f"failed (exit {done.returncode}): {errors[-1].strip()}"
    return dict(json.loads(lines[-1]))


def _config(args: argparse.Namespace, width: int) -> str:
    return f"gpt d={width} L={args.layers} V={args.vocab} seq={args.seq} b={args.batch} adamw"


def _record(args: argparse.Namespace, system: str, width: int, res: dict[str, Any]) -> dict[str, Any]:
    skip = ("step_time_s", "peak_rss_mb", "final_loss", "params", "step_times")
    return {
        "bench": "memory",
        "system": NAMES[system],
        "config": _config(args, width),
        "step_time_s": round(res["step_time_s"], 4),
        "tokens_per_s": round(args.batch * args.seq / res["step_time_s"], 1),
        "peak_rss_mb": round(res["peak_rss_mb"], 1),
        "model_state_bytes": 16 * res["params"],
        "final_loss": round(res["final_loss"], 4),
        "params": res["params"],
        "fits_cap": res["peak_rss_mb"] <= args.cap_mib,
        "cap_mib": args.cap_mib,
        **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items() if k not in skip},
    }


def _ladder(
    args: argparse.Namespace, system: str, widths: list[int], disk_dir: str
) -> tuple[list[dict[str, Any]], str]:
    """Ascending sizes until one passes the cap or fails; the records and how the ladder ended."""
    records: list[dict[str, Any]] = []
    for width in widths:
        res = run_one(args, system, width, disk_dir, args.steps)
        if isinstance(res, str):
            emit({"bench": "memory", "system": NAMES[system], "config": _config(args, width),
                  "step_time_s": 0.0, "tokens_per_s": 0.0, "error": res})  # fmt: skip
            return records, f"d={width}: {res}"
        record = _record(args, system, width, res)
        emit(record)
        records.append(record)
        if not record["fits_cap"]:
            return records, f"d={width} over the cap"
    return records, "every size fit"


def _step_times(
    args: argparse.Namespace, systems: list[str], width: int, disk_dir: str
) -> list[dict[str, Any]]:
    """(b): every system at one width, ``--rounds`` rounds with the order rotated each round."""
    times: dict[str, list[float]] = {s: [] for s in systems}
    last: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
            res = run_one(args, system, width, disk_dir, args.time_steps)
            if isinstance(res, str):
                logger.warning("%s at d=%d: %s", system, width, res)
                continue
            times[system] += res["step_times"]
            last[system] = res
    medians = {s: statistics.median(t) for s, t in times.items() if t}
    base = medians.get("zero3")
    records = []
    for system, median in medians.items():
        res = last[system]
        records.append(
            {
                "bench": "memory",
                "system": NAMES[system],
                "config": f"step time: {_config(args, width)} rounds={args.rounds} steps={args.time_steps}",
                "step_time_s": round(median, 4),
                "tokens_per_s": round(args.batch * args.seq / median, 1),
                "peak_rss_mb": round(res["peak_rss_mb"], 1),
                "final_loss": round(res["final_loss"], 4),
                "params": res["params"],
                "time_ratio_vs_tessera_zero3": round(median / base, 3) if base else None,
                "timed_steps": len(times[system]),
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, default="zero3", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--disk-dir", default=None, help="where the disk tiers write (default: a temp dir)")
    parser.add_argument("--cap-mib", type=float, default=1024.0, help="resident-memory cap per rank")
    parser.add_argument("--host-budget-mib", type=float, default=64.0, help="the disk system's host budget")
    parser.add_argument("--widths", default="256,512,768,1024,1280,1536", help="model widths, ascending")
    parser.add_argument("--systems", default=",".join(ALL), help=f"comma-separated, of {', '.join(ALL)}")
    parser.add_argument(
        "--deepspeed-python",
        default=None,
        help="a Python with DeepSpeed installed (default: benchmarks/out/peers/deepspeed, made if missing)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--time-widths", default="", help="(b)'s widths, comma-separated (default: see doc)")
    parser.add_argument("--time-steps", type=int, default=6, help="steps per (b) run (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="(b)'s rounds over the systems")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    logging.basicConfig(level=logging.WARNING)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(ALL))
    if unknown:
        raise ValueError(f"--systems has {unknown}; choose of {list(ALL)}")
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="tessera-bench-memory-")
    widths = [int(w) for w in args.widths.split(",")]
    ds_version = ""
    if any(s.startswith("deepspeed") for s in systems):
        if args.deepspeed_python is None:
            args.deepspeed_python = str(peer_python("deepspeed"))
        ds_version = deepspeed_version(args.deepspeed_python)
    records: list[dict[str, Any]] = []
    ran: list[str] = []
    for system in systems:
        recs: list[dict[str, Any]] = []
        if system.startswith("deepspeed") and ds_version.startswith("not available"):
            ended = ds_version
        else:
            recs, ended = _ladder(args, system, widths, disk_dir)
        records += recs
        if recs:
            ran.append(system)
        under = [r for r in recs if r["fits_cap"]]
        emit(
            {
                "bench": "memory",
                "system": NAMES[system],
                "config": f"largest under {args.cap_mib:g} MiB",
                "step_time_s": 0.0,
                "tokens_per_s": 0.0,
                "largest_params": max((r["params"] for r in under), default=0),
                "ladder_ended": ended,
                "needs": NEEDS[system] + (f" ({ds_version})" if system.startswith("deepspeed") else ""),
            }
        )
    timed: list[dict[str, Any]] = []
    for width in [int(w) for w in args.time_widths.split(",") if w] or [_common_width(records, ran, widths)]:
        timed += _step_times(args, ran, width, disk_dir) if ran and width else []
    for rec in timed:
        emit(rec)
    if not args.disk_dir:
        shutil.rmtree(disk_dir, ignore_errors=True)
    keys = ("system", "params", "peak_rss_mb", "train_peak_rss_mb", "step_time_s", "fits_cap")
    disk = ("disk_read_per_step", "formula_read_per_step", "disk_written_per_step")
    if records:  # table() needs at least one row
        table(records, (*keys, *disk, "formula_written_per_step"))
    if timed:
        table(timed, ("system", "config", "step_time_s", "time_ratio_vs_tessera_zero3", "timed_steps"))


def _common_width(records: list[dict[str, Any]], ran: list[str], widths: list[int]) -> int:
    """The largest width every system that ran trained under the cap, else the smallest they all trained."""
    done = {(r["system"], int(r["config"].split()[1][2:])): r["fits_cap"] for r in records}
    names = [NAMES[s] for s in ran]
    under = [w for w in widths if all(done.get((n, w)) is True for n in names)]
    trained = [w for w in widths if all((n, w) in done for n in names)]
    return max(under) if under else min(trained, default=0)


if __name__ == "__main__":
    main()
