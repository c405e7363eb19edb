"""Context parallelism (``tessera.tensor_parallel.context``) on gloo ranks: the reference GPT
with its sequence split over cp=2 and cp=4 ranks (ring and Ulysses attention) beside the
serial GPT (system "serial", the peer), in one run; cp=2 in a ``WorkerPool(2)``, cp=4 in a
``WorkerPool(4)`` (on this 2-core machine 4 ranks share 2 cores: see the step time note).

Three measurements:

(a) ``memory``: activation bytes per rank of one forward + backward at ``--mem-seqs``: the
    storage bytes of every tensor autograd saves for backward (a ``saved_tensors_hooks``
    pack hook, parameters excluded, views of one storage counted once by
    ``tessera.comm.storage_bytes``), read at the end of the forward, when they are all
    alive. This is exact and deterministic (the same bytes on every run), unlike RSS on a
    shared CPU (allocator caching, arenas, other processes); it leaves out transients that
    live only inside one op (the ring's score block of (local_seq)^2 per head, freed before
    the next block). ``activation_ratio_vs_serial`` is at the longest length;
    ``ratio_times_cp`` = that ratio * cp (goal: within 10% of 1). The longest sequence
    that fits ``--budget-mib`` per rank comes from a least-squares fit of bytes =
    a + b*seq + c*seq^2 over the measured lengths (c is ~0 where memory is linear):
    ``max_seq_in_budget`` (rounded down to a multiple of 2*cp), ``bytes_per_token`` (the
    slope between the two longest lengths).
(b) ``step``: one training step (forward, backward, gradient sum over cp, AdamW) at
    ``--seq`` tokens, median of ``--iters`` steps after ``--warmup``; the systems alternate
    step by step so background load hits them alike; the slower rank counts. Serial runs
    on each rank of the cp=2 pool at once (one thread each, like every pool worker), so it
    is the one-core time of the whole model. ``ratio_vs_peer`` = serial / cp step time.
    ``loss_match``: the first step's loss (same init, same batch) equals the serial GPT's
    loss on that batch (computed in the launching process) within rtol 1e-5 + atol 1e-5
    (``loss_diff`` gives the gap).
(c) ``balance``: causal ring attention alone (``ring_attention``, forward + backward of
    (batch, heads, --balance-seq/cp, head_dim) fp32 q, k, v) at cp=4 with the
    ``contiguous`` and ``zigzag`` layouts; each repetition starts after a barrier. Busy
    time per rank = CPU time of the rank's main thread over the call
    (``time.thread_time``): it counts the block arithmetic and excludes time blocked in
    ``wait()`` for a K/V or dK/dV block (gloo waits sleep) and time descheduled by the 4
    ranks sharing 2 cores. ``busy_max_over_mean`` (goal for zigzag: <= 1.10) per layout,
    median over ``--balance-reps``; ``wall_max_over_mean`` is the same from wall time
    (barrier to end of backward, waits included).

A token is one sequence position of the (global) batch: ``tokens_per_s`` = batch * seq /
step time. Lines of one measurement share ``config`` (the workload); ``cp``, ``mode`` and
``layout`` tell the variants apart (serial: cp=1, mode "serial").
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from _common import emit, table
from torch import Tensor, nn

from tessera.comm import storage_bytes
from tessera.comm.testing import WorkerPool
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel.context import (
    context_parallel_loss,
    context_parallelize,
    ring_attention,
    split_batch,
    sync_context_parallel_grads,
)

ADAMW = {"lr": 1e-4, "weight_decay": 0.1}
MODES = ("ring", "ulysses")
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
Variant = tuple[str, str]  # (mode, layout); mode "serial" for the peer


def _cfg(args: dict[str, int], seq: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=args["vocab"],
        seq_len=seq,
        d_model=args["d_model"],
        n_heads=args["heads"],
        n_layers=args["layers"],
    )


def _build(cfg: GPTConfig, variant: Variant) -> nn.Module:
    model = GPT(cfg, seed=0)
    mode, layout = variant
    if mode == "serial":
        return model
    return context_parallelize(model, None, mode=mode, layout=layout, heads=cfg.n_heads)


def _loss(model: nn.Module, variant: Variant, idx: Tensor, targets: Tensor) -> Tensor:
    """The global mean loss (serial: the plain GPT loss on the whole batch)."""
    if variant[0] == "serial":
        return model.loss(idx, targets)  # type: ignore[operator,no-any-return]
    idx, targets = split_batch(idx, targets, group=None, layout=variant[1])
    return context_parallel_loss(model(idx), targets, None)


# ---------------------------------------------------------------- (a) activation memory
def saved_bytes(model: nn.Module, forward: Callable[[], Tensor]) -> int:
    """Storage bytes of the tensors autograd saves during ``forward()`` (parameters excluded);
    then runs the backward so the step is a whole training step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    total = storage_bytes(saved)
    saved.clear()
    torch.autograd.backward(loss)
    return total


def _memory(args: dict[str, int], seqs: list[int], variant: Variant) -> dict[int, int]:
    out: dict[int, int] = {}
    for seq in seqs:
        cfg = _cfg(args, seq)
        model = _build(cfg, variant)
        idx, targets = make_batch(cfg, args["batch"], seed=7)
        out[seq] = saved_bytes(model, partial(_loss, model, variant, idx, targets))
    return out


def fit_max_seq(by_seq: dict[int, int], budget: int, multiple: int) -> tuple[int | None, float, float]:
    """(longest seq within ``budget`` bytes, bytes per token, quadratic coefficient) from a
    least-squares fit of bytes = a + b*s + c*s^2 (linear with fewer than 3 lengths)."""
    seqs = sorted(by_seq)
    xs = torch.tensor(seqs, dtype=torch.float64)
    ys = torch.tensor([by_seq[s] for s in seqs], dtype=torch.float64)
    slope = float((ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) if len(seqs) > 1 else float(ys[0] / xs[0])

    def fit(powers: int) -> list[float]:
        cols = torch.stack([xs**p for p in range(powers)], 1)
        return [float(x) for x in torch.linalg.lstsq(cols, ys[:, None]).solution.squeeze(1)]

    coef = fit(3) if len(seqs) > 2 else []
    if not coef or coef[2] <= 1e-9 * abs(coef[1]):  # no significant quadratic term: a line
        coef = [*fit(2), 0.0] if len(seqs) > 1 else [0.0, slope, 0.0]
    a, b, c = coef
    rest = budget - a
    if c > 0:
        s = (-b + math.sqrt(b * b + 4 * c * rest)) / (2 * c) if b * b + 4 * c * rest >= 0 else -1.0
    else:
        s = rest / b if b > 0 else -1.0
    best = int(s) // multiple * multiple
    return (best if best > 0 else None), slope, c


# ---------------------------------------------------------------- (b) step time
class Trainer:
    """One system on this rank: ``step(i)`` trains on batch i and returns the global loss."""

    def __init__(self, cfg: GPTConfig, batch: int, variant: Variant) -> None:
        self.cfg, self.batch, self.variant = cfg, batch, variant
        self.model = _build(cfg, variant)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)  # type: ignore[arg-type]

    def step(self, i: int) -> float:
        idx, targets = make_batch(self.cfg, self.batch, seed=1000 + i)
        loss = _loss(self.model, self.variant, idx, targets)
        torch.autograd.backward(loss)
        if self.variant[0] != "serial":
            sync_context_parallel_grads(self.model, None)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def _steps(
    args: dict[str, int], variants: list[Variant], warmup: int, iters: int
) -> dict[Variant, dict[str, float]]:
    cfg = _cfg(args, args["seq"])
    tiny = GPTConfig(vocab_size=64, seq_len=8 * dist.get_world_size(), d_model=16, n_heads=4, n_layers=1)
    for variant in variants:  # first use of each code path outside the timings
        Trainer(tiny, 1, variant).step(0)
    systems = {v: Trainer(cfg, args["batch"], v) for v in variants}
    out: dict[Variant, dict[str, float]] = {v: {} for v in variants}
    times: dict[Variant, list[float]] = {v: [] for v in variants}
    for i in range(warmup + iters):
        for v, system in systems.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = system.step(i)
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
            if i == 0:
                out[v]["first_loss"] = loss
            out[v]["final_loss"] = loss
    for v in variants:
        out[v]["step_time_s"] = statistics.median(times[v])
    return out


# ---------------------------------------------------------------- (c) causal load balance
def _balance(args: dict[str, int], layouts: list[str], reps: int) -> dict[str, dict[str, float]]:
    cp, rank = dist.get_world_size(), dist.get_rank()
    heads, head_dim = args["heads"], args["d_model"] // args["heads"]
    local = args["balance_seq"] // cp
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (
        torch.randn(args["batch"], heads, local, head_dim, generator=gen).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(args["batch"], heads, local, head_dim, generator=gen)
    out: dict[str, dict[str, float]] = {}
    for layout in layouts:
        torch.autograd.backward(ring_attention(q, k, v, group=None, causal=True, layout=layout), grad)  # warm
        busy, wall = [], []
        for _ in range(reps):
            q.grad = k.grad = v.grad = None
            dist.barrier()
            w0, c0 = time.perf_counter(), time.thread_time()
            torch.autograd.backward(ring_attention(q, k, v, group=None, causal=True, layout=layout), grad)
            busy.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
        out[layout] = {"busy_s": statistics.median(busy), "wall_s": statistics.median(wall)}
    dist.barrier()
    return out


# ---------------------------------------------------------------- the worker entry
def _run(rank: int, args: dict[str, int], mem_seqs: list[int], layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    cp = dist.get_world_size()
    variants: list[Variant] = [(m, layout) for m in MODES]
    result: dict[str, Any] = {
        "memory": {v: _memory(args, mem_seqs, v) for v in variants},
    }
    dist.barrier()
    timed = [("serial", "contiguous"), *variants] if cp == 2 else variants
    result["steps"] = _steps(args, timed, args["warmup"], args["iters"])
    if cp == 4:
        result["balance"] = _balance(args, ["contiguous", "zigzag"], args["balance_reps"])
    return result


def _table(records: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    if records:
        table(records, keys)


def _r(x: float, digits: int = 4) -> float:
    return round(x, digits)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4, help="must divide by 4 (Ulysses at cp=4)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096, help="(b) step-time sequence length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"), help="(a), (b)")
    parser.add_argument("--mem-seqs", default="1024,2048,4096", help="(a) sequence lengths, comma-separated")
    parser.add_argument("--budget-mib", type=float, default=64.0, help="(a) activation budget per rank")
    parser.add_argument("--balance-seq", type=int, default=4096, help="(c) sequence length")
    parser.add_argument("--balance-reps", type=int, default=5)
    parser.add_argument("--worlds", default="2,4", help="cp degrees to run (2 and/or 4)")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args = {
        "d_model": ns.d_model,
        "heads": ns.heads,
        "layers": ns.layers,
        "vocab": ns.vocab,
        "batch": ns.batch,
        "seq": ns.seq,
        "warmup": ns.warmup,
        "iters": ns.iters,
        "balance_seq": ns.balance_seq,
        "balance_reps": ns.balance_reps,
    }
    mem_seqs = sorted(int(s) for s in ns.mem_seqs.split(","))
    worlds = [int(w) for w in ns.worlds.split(",")]
    budget = int(ns.budget_mib * 2**20)
    torch.set_num_threads(1)  # like the pool workers

    per_world: dict[int, list[dict[str, Any]]] = {}
    for world in worlds:
        with WorkerPool(world, timeout=1800) as pool:
            per_world[world] = pool.run(_run, args, mem_seqs, ns.layout)
    serial_mem = _memory(args, mem_seqs, ("serial", "contiguous"))

    model = f"gpt d={ns.d_model} heads={ns.heads} L={ns.layers} V={ns.vocab} batch={ns.batch} fp32 gloo"
    records: list[dict[str, Any]] = []

    # (a) memory
    mem_config = f"memory seqs={','.join(map(str, mem_seqs))} budget={ns.budget_mib:g}MiB {model}"
    longest = mem_seqs[-1]
    entries: list[tuple[int, str, str, dict[int, int]]] = [(1, "serial", "-", serial_mem)]
    for world in worlds:
        for mode in MODES:
            by_seq = max(
                (r["memory"][(mode, ns.layout)] for r in per_world[world]), key=lambda d: d[longest]
            )
            entries.append((world, mode, ns.layout, by_seq))
    for cp, mode, layout, by_seq in entries:
        max_seq, slope, quad = fit_max_seq(by_seq, budget, 1 if cp == 1 else 2 * cp)
        ratio = by_seq[longest] / serial_mem[longest]
        records.append(
            {
                "bench": "cp",
                "system": "serial" if cp == 1 else "tessera",
                "config": mem_config,
                "step_time_s": None,
                "tokens_per_s": None,
                "cp": cp,
                "mode": mode,
                "layout": layout,
                "activation_bytes": by_seq[longest],
                "activation_bytes_by_seq": {str(s): b for s, b in by_seq.items()},
                "activation_ratio_vs_serial": _r(ratio),
                "ratio_times_cp": _r(ratio * cp),
                "bytes_per_token": round(slope, 1),
                "quadratic_bytes_per_token2": round(quad, 4),
                "max_seq_in_budget": max_seq,
            }
        )

    # (b) step time
    step_config = f"step seq={ns.seq} {model} AdamW"
    tokens = ns.batch * ns.seq
    serial_key = ("serial", "contiguous")
    serial_steps = [r["steps"][serial_key] for r in per_world[2]] if 2 in worlds else None
    serial_time = max(s["step_time_s"] for s in serial_steps) if serial_steps else None
    with torch.no_grad():  # the serial first-step loss for loss_match, whichever worlds ran
        step_cfg = _cfg(args, ns.seq)
        serial_loss = GPT(step_cfg, seed=0).loss(*make_batch(step_cfg, ns.batch, seed=1000)).item()
    if serial_steps is not None and serial_time is not None:
        records.append(
            {
                "bench": "cp",
                "system": "serial",
                "config": step_config,
                "step_time_s": _r(serial_time),
                "tokens_per_s": round(tokens / serial_time, 1),
                "cp": 1,
                "mode": "serial",
                "layout": "-",
                "final_loss": round(serial_steps[0]["final_loss"], 5),
                "ratio_vs_peer": None,
            }
        )
    for world in worlds:
        for mode in MODES:
            runs = [r["steps"][(mode, ns.layout)] for r in per_world[world]]
            t = max(s["step_time_s"] for s in runs)
            first = runs[0]["first_loss"]
            diff = abs(first - serial_loss)
            records.append(
                {
                    "bench": "cp",
                    "system": "tessera",
                    "config": step_config,
                    "step_time_s": _r(t),
                    "tokens_per_s": round(tokens / t, 1),
                    "cp": world,
                    "mode": mode,
                    "layout": ns.layout,
                    "final_loss": round(runs[0]["final_loss"], 5),
                    "ratio_vs_peer": None if serial_time is None else _r(serial_time / t, 3),
                    "loss_diff": diff,
                    "loss_match": diff <= LOSS_ATOL + LOSS_RTOL * abs(serial_loss),
                }
            )

    # (c) load balance
    if 4 in worlds:
        bal_config = (
            f"balance causal ring_attention fwd+bwd seq={ns.balance_seq} heads={ns.heads} "
            f"head_dim={ns.d_model // ns.heads} batch={ns.batch} fp32 gloo"
        )
        for layout in ("contiguous", "zigzag"):
            busy = [r["balance"][layout]["busy_s"] for r in per_world[4]]
            wall = [r["balance"][layout]["wall_s"] for r in per_world[4]]
            records.append(
                {
                    "bench": "cp",
                    "system": "tessera",
                    "config": bal_config,
                    "step_time_s": _r(max(wall)),
                    "tokens_per_s": round(ns.batch * ns.balance_seq / max(wall), 1),
                    "cp": 4,
                    "mode": "ring",
                    "layout": layout,
                    "busy_s_per_rank": [_r(b) for b in busy],
                    "busy_max_over_mean": _r(max(busy) / statistics.mean(busy), 3),
                    "wall_s_per_rank": [_r(w) for w in wall],
                    "wall_max_over_mean": _r(max(wall) / statistics.mean(wall), 3),
                }
            )

    for rec in records:
        emit(rec)
    _table(
        [r for r in records if r["config"] == mem_config],
        (
            "system",
            "cp",
            "mode",
            "activation_bytes",
            "ratio_times_cp",
            "bytes_per_token",
            "max_seq_in_budget",
        ),
    )
    _table(
        [r for r in records if r["config"] == step_config],
        ("system", "cp", "mode", "step_time_s", "tokens_per_s", "ratio_vs_peer", "loss_match", "final_loss"),
    )
    _table(
        [r for r in records if "busy_max_over_mean" in r],
        ("layout", "busy_s_per_rank", "busy_max_over_mean", "wall_max_over_mean"),
    )


if __name__ == "__main__":
    main()
