"""Shared helpers of the benchmarks: the JSON-line contract, timing and memory readings."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # _memory_peers runs this module in a venv without Tessera
    from tessera.models import GPTConfig

REQUIRED = ("bench", "system", "config", "step_time_s", "tokens_per_s")
OPTIONAL = ("peak_rss_mb", "model_state_bytes", "comm_bytes", "final_loss")


def emit(record: dict[str, Any]) -> None:
    """Print one result as a JSON line after checking it has the contract's keys."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"benchmark record lacks {missing}: {record}")
    print(json.dumps(record, sort_keys=False), flush=True)


def median_time(step: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time in seconds of ``step()`` over ``iters`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_s() -> float:
    """CPU seconds this process has used (every thread: the collectives' lanes too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def table(records: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    """Print a fixed-width table of ``records`` to stderr (stdout carries only JSON lines)."""
    rows = [[str(r.get(k, "")) for k in keys] for r in records]
    widths = [max(len(k), *(len(row[i]) for row in rows)) for i, k in enumerate(keys)]
    for row in [list(keys), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)), file=sys.stderr)


# ---------------------------------------------------------------------- resident memory
def status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``); 0 when absent."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def libc_handle() -> ctypes.CDLL | None:
    """glibc, for ``malloc_trim``; None where it is not there."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def malloc_for_rss() -> None:
    """glibc's mmap and trim thresholds fixed at their 128 KiB defaults: every larger tensor is
    its own mapping, unmapped when freed, and the heap's free top goes back to the system, so
    the resident set follows the live bytes instead of what the heap happens to retain. Page
    faults on every large allocation make steps slower: measure memory under this, time
    under `malloc_for_speed`."""
    libc = libc_handle()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def malloc_for_speed() -> None:
    """glibc's thresholds as high as its own dynamic adjustment takes them (mmap 32 MiB, trim
    twice that), as in an ordinary torch process once it has freed large tensors: freed
    blocks stay in the heap for reuse. Under `malloc_for_rss` the planner bench's steps were
    20-35% slower, unevenly (tp2 with Megatron SP, whose many 512 KiB buffers each fault
    their pages in, the most)."""
    libc = libc_handle()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 * 2**20)


def rss_baseline() -> int:
    """Collect garbage, return freed heap to the system, reset VmHWM; the resident kB now."""
    gc.collect()
    libc = libc_handle()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    return status_kb("VmRSS")


def add_gpt_args(parser: argparse.ArgumentParser, *, seq: int, batch: int, iters: int) -> None:
    """The reference GPT's shape and the timing options the tp and overhead benches share
    (d=256, 8 heads, 4 layers, V=4096 by default); ``gpt_config`` reads them back."""
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=iters)


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The ``GPTConfig`` of ``add_gpt_args``' options."""
    from tessera.models import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
    )


def run_ranks(
    cmd: list[str], env: dict[str, str], world: int, timeout: float, *, cwd_in_store: bool = False
) -> list[dict[str, Any]] | str:
    """``cmd`` as ``world`` processes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set, ``env`` over
    this process's environment) sharing a FileStore (``--store`` appended), all ended by
    ``timeout``: each rank's last JSON line, or one line saying why there are none (the first
    failing rank's last stderr line). ``cwd_in_store``: run them in the store's temporary folder
    (for peers that write beside the working directory)."""
    store = tempfile.mkdtemp(prefix="tessera-bench-")
    full_env = {**os.environ, **env}
    procs = [
        subprocess.Popen(
            [*cmd, "--store", f"{store}/store"],
            env={**full_env, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=store if cwd_in_store else None,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    results: list[dict[str, Any]] = []
    failure = ""
    try:
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failure = failure or f"failed: timed out after {timeout:g} s"
                continue
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if p.returncode != 0 or not lines:
                errors = [line for line in err.strip().splitlines() if line.strip()] or ["(no stderr)"]
                failure = failure or f"failed (rank {r}, exit {p.returncode}): {errors[-1].strip()}"
                continue
            results.append(dict(json.loads(lines[-1])))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(store, ignore_errors=True)
    return failure or results
