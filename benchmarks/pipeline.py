"""Pipeline parallelism: Tessera's runtime, measured two ways, on gloo worker processes.

1. ``bubble``: p = 4 ranks, m = 8 microbatches, stages whose compute is a fixed sleep (F, B
   and W each ``--sleep-ms`` per virtual stage and microbatch; BW sleeps B + W), so the idle
   time measured is the schedule's, not the CPU's. For every schedule, one line
   with ``bubble_measured`` (per rank ``1 - busy / makespan``, busy timed around each
   compute, makespan from the first rank's start to the last compute anywhere; averaged
   over ranks, median over steps) beside ``bubble_simulated`` (`tessera.pipeline.simulate`
   with the same costs). A "token" is one microbatch.
   The first stage is ``Sequential(Identity, SleepStage)``, like an embedding before layers.
2. ``gpt``: the reference GPT at p = 2 (v = 1 and v = 2), m = 8, each Tessera schedule beside
   torch.distributed.pipelining (system "torch-pipelining": Schedule1F1B,
   ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, and also ScheduleGPipe and
   ScheduleZBVZeroBubble) on the same partition by parameters (torch's interleaved schedules
   get the loop layout, ZBV the V layout; balanced per rank, `partition_by_params`'
   default: with two stages per rank, stage balancing alone gives ZBV's rank 1 four of the
   six layers), initial weights, data
   and SGD steps (zero grads, forward/backward, step). The two systems alternate steps
   (ABBA) so that both see the same machine load; a step's time runs from the barrier
   before it to the last rank's end.
   ``ratio_vs_peer`` is the ratio of the median step times, ``ratio_paired_median`` the
   median of the ratios of back-to-back steps (steadier on a shared machine).
   ``final_loss`` is the mean microbatch loss of the last step; both sides must agree
   (``loss_match``). A "token" is one sequence position.
   ``zb-h1+tune`` and ``zbv+tune`` run those schedules as `boost()` does, with
   ``tune_splits=2``: the runtime times the schedule as built, unsplit and merged
   (`merge_splits` under the costs it fitted) and keeps the fastest; its tuning steps run
   before the timed ones, gradients dropped (the line's ``tuned_form``, ``tuning_step_s``,
   ``splits_kept`` and ``fitted_costs_s`` say what it measured and kept). The last four
   pairs put each zero-bubble schedule, as built and tuned, beside Tessera's own 1F1B
   (system ``tessera-1f1b``), step for step: the goal that zero-bubble is at least as fast
   as 1F1B; a pair of 1F1B against itself before them shows how far two runtimes of one
   schedule differ in such a pair. ``ideal_step_s`` is the median over the timed steps of
   `replay`: the schedule timed with the compute durations each step measured and instant
   messages, the critical path no runtime of that schedule can beat with those
   computations; ``vs_ideal`` is the median step over it (the step also zeroes the
   gradients and takes the SGD step, which the ideal leaves out). A torch line of the same
   schedule (GPipe, 1F1B, interleaved 1F1B, ZBV as built; the last two may order their
   actions a little differently) has the ideal of Tessera's side: the same modules on the
   same partition.
   A ``torch-single`` line (system) runs the same GPT in plain PyTorch in one process (rank
   0, one thread, rank 1 idle at a barrier): the same work as one pipeline step, the whole
   batch of m x mb sequences in one forward and backward (the mean loss over equal
   microbatches is the mean over the batch) and an SGD step; ``speedup_vs_single`` on each
   gpt line is its tokens/s over that one's.
3. ``--breakdown`` (gpt part): after the timed steps, ``--breakdown-steps`` more of each
   system run under torch.profiler on both ranks; rank 0's split of a step into compute /
   communication / idle (waiting for the peer's activations or gradients) / overhead
   (``benchmarks/_breakdown.py``) goes into the line, the Chrome traces and a stacked-bar
   ``breakdown.png`` into the run folder (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp
import torch.nn.functional as F
from _breakdown import Breakdown, add_breakdown_args, breakdown_folder, plot, profile_steps
from _common import emit, table
from torch import Tensor, nn

from tessera.comm.testing import WorkerPool
from tessera.models import GPT, GPTConfig, make_batch
from tessera.pipeline import (
    SCHEDULES,
    Costs,
    Layout,
    Partition,
    PipelineRuntime,
    Schedule,
    TimedAction,
    build_schedule,
    partition_by_params,
    replay,
    schedule_spec,
    simulate,
    stage_modules,
    stage_to_rank,
)
from tessera.pipeline.tune import SplitTuner


# ---------------------------------------------------------------------------- 1. bubble
class _SleepGrad(torch.autograd.Function):
    """Identity whose backward sleeps: the B part (input path) or W part (weight path)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """A stage costing ``f`` seconds forward, ``b`` for its input gradient, ``w`` for its weight."""

    def __init__(self, f: float, b: float, w: float, width: int) -> None:
        super().__init__()
        self.f, self.b, self.w = f, b, w
        self.weight = nn.Parameter(torch.zeros(width))
        self.anchor = nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.f)
        if not x.requires_grad:  # the first stage under BW: its layers' input-gradient work still runs
            x = x + self.anchor
        return _sleep_grad(x, self.b) + _sleep_grad(self.weight, self.w)


def _sleep_grad(x: Tensor, seconds: float) -> Tensor:
    return cast(Tensor, _SleepGrad.apply(x, seconds))  # type: ignore[no-untyped-call]


def _sleep_stages(schedule: Schedule, rank: int, cost: float) -> dict[int, nn.Module]:
    """This rank's sleeping stages. Stage 0 is ``Sequential(Identity, SleepStage)`` like an
    embedding before layers, so its B has the layers' input-gradient work (see the runtime)."""
    stages: dict[int, nn.Module] = {s: SleepStage(cost, cost, cost, 4) for s in schedule.stages_of(rank)}
    if 0 in stages:
        stages[0] = nn.Sequential(nn.Identity(), stages[0])
    return stages


def _sum_loss(y: Tensor, _targets: Tensor) -> Tensor:
    return y.sum()


def _bubble(
    rank: int, name: str, p: int, m: int, cost: float, steps: int
) -> list[tuple[float, float, float]]:
    """Per step: (start, end of last compute, busy seconds) on this rank."""
    schedule = build_schedule(name, p, m)
    runtime = PipelineRuntime(schedule, _sleep_stages(schedule, rank, cost), _sum_loss)
    x, targets = torch.zeros(m, 4), torch.zeros(m)
    out = []
    for _ in range(steps):
        dist.barrier()
        result = runtime.step(x, targets)
        end = max(t.end for t in result.timeline)
        out.append((result.started, end, result.busy))
    return out


def bench_bubble(sleep_ms: float, steps: int, only: list[str]) -> list[dict[str, Any]]:
    p, m, cost = 4, 8, sleep_ms / 1000
    records = []
    with WorkerPool(p, timeout=900) as pool:
        for name, spec in SCHEDULES.items():
            v = spec.chunks()
            if only and name not in only:
                continue
            per_rank = pool.run(_bubble, name, p, m, cost, steps + 1)
            makespans, bubbles = [], []
            for step in range(1, steps + 1):  # the first step warms up
                rows = [r[step] for r in per_rank]
                makespan = max(end for _, end, _ in rows) - min(start for start, _, _ in rows)
                makespans.append(makespan)
                bubbles.append(statistics.fmean(1 - busy / makespan for *_, busy in rows))
            split = name in ("zb-h1", "zbv")
            sim = simulate(build_schedule(name, p, m, v), Costs(f=cost, b=cost, w=cost))
            step_time = statistics.median(makespans)
            records.append({
                "bench": "pipeline",
                "system": "tessera",
                "config": f"bubble sleep F=B=W={sleep_ms:g}ms/stage p={p} v={v} m={m} {name}"
                + (" (B/W split)" if split else " (BW = B + W)"),
                "step_time_s": round(step_time, 4),
                "tokens_per_s": round(m / step_time, 2),
                "bubble_measured": round(statistics.median(bubbles), 4),
                "bubble_simulated": round(sim.mean_bubble, 4),
                "makespan_simulated_s": round(sim.makespan, 4),
            })
    return records


# ---------------------------------------------------------------------------- 2. gpt
def _ce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _torch_schedule(cls_name: str, stages: list[tpp.PipelineStage], m: int) -> Any:
    cls = getattr(tpp, cls_name)
    if cls_name in ("ScheduleGPipe", "Schedule1F1B"):
        return cls(stages[0], m, loss_fn=_ce)
    return cls(stages, m, loss_fn=_ce)


def _gpt_single(rank: int, cfg: GPTConfig, m: int, mb: int, warmup: int, iters: int, lr: float,
                folder: str | None, prof_steps: int) -> dict[str, Any]:
    """Rank 0: the whole GPT on the whole batch in one process (SGD); rank 1 waits."""
    out: dict[str, Any] = {}
    if rank == 0:
        model = GPT(cfg, seed=0)
        idx, targets = make_batch(cfg, m * mb, seed=1)
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = _ce(model(idx), targets)
            torch.autograd.backward(loss)
            opt.step()
            return float(loss.detach())

        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            out["final"] = step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out["median"] = statistics.median(times)
        if folder is not None:
            trace = f"{folder}/single-rank0.json"
            out |= {"breakdown": profile_steps(step, prof_steps, trace).as_record(), "breakdown_trace": trace}
    dist.barrier()
    return out


def _gpt_pair(
    rank: int, ours: str, theirs: str, cfg: GPTConfig, m: int, mb: int, warmup: int, iters: int, lr: float,
    folder: str | None = None, prof_steps: int = 3,
) -> dict[str, Any]:
    """Alternate Tessera and torch steps (each: zero grads, forward/backward, SGD)."""
    p = dist.get_world_size()
    idx, targets = make_batch(cfg, m * mb, seed=1)
    side = _tessera_side(ours, cfg, m, idx, targets, lr)
    part = side.part
    v = part.num_stages // p
    probe = GPT(cfg, seed=0).blocks()
    if theirs in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble") and v > 1:
        torch_part = partition_by_params(probe, stage_to_rank(Layout.LOOP, p, v))  # torch's loop layout
    else:
        torch_part = part
    own = theirs.removeprefix("tessera:")
    peer = f"tessera-{own}" if own != theirs else "torch-pipelining"
    sides = {"tessera": side}
    if own != theirs:  # Tessera's own schedule as the peer (zero-bubble against 1F1B)
        sides[peer] = _tessera_side(own, cfg, m, idx, targets, lr)
        steps = {system: s.step for system, s in sides.items()}
    else:  # torch.distributed.pipelining
        theirs_step = _torch_step(theirs, cfg, torch_part, m, idx, targets, lr)
        steps = {"tessera": side.step, "torch-pipelining": theirs_step}
    extra = {**side.extra, "peer": peer}
    out = _alternate(rank, ours, theirs, steps, warmup, iters, folder, prof_steps, extra)
    out["ideal"] = {system: _ideal(s, warmup, iters) for system, s in sides.items()}
    return out


def _torch_step(
    name: str, cfg: GPTConfig, part: Any, m: int, idx: Tensor, targets: Tensor, lr: float
) -> Callable[[], float | None]:
    """One step of torch.distributed.pipelining's schedule ``name`` on ``part``."""
    rank, last = dist.get_rank(), part.num_stages - 1
    p_mods = stage_modules(GPT(cfg, seed=0).blocks(), part, rank)
    cpu = torch.device("cpu")
    p_stages = [tpp.PipelineStage(mod, s, part.num_stages, cpu) for s, mod in p_mods.items()]
    schedule = _torch_schedule(name, p_stages, m)
    p_opt = torch.optim.SGD([q for s in p_mods.values() for q in s.parameters()], lr=lr)
    p_has = (0 in p_mods, last in p_mods)

    def torch_step() -> float | None:
        p_opt.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        args = (idx,) if p_has[0] else ()
        if p_has[1]:
            schedule.step(*args, target=targets, losses=losses)
        else:
            schedule.step(*args)
        p_opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    return torch_step


@dataclass
class _Side:
    """One Tessera system of a pair: its step (zero grads, pipeline step, SGD), partition,
    runtime, the timelines of every step it ran, and what its tuning measured."""

    step: Callable[[], float | None]
    part: Partition
    runtime: PipelineRuntime
    timelines: list[tuple[TimedAction, ...]]
    extra: dict[str, Any]


def _tessera_side(name: str, cfg: GPTConfig, m: int, idx: Tensor, targets: Tensor, lr: float) -> _Side:
    """Schedule ``name`` on Tessera's runtime; ``+tune``: with ``tune_splits=2`` as `boost()`
    runs it, its tuning steps (gradients dropped, no optimizer step, so the weights stay
    those both systems start from) run first."""
    rank, p = dist.get_rank(), dist.get_world_size()
    base, _, tune = name.partition("+")
    schedule = build_schedule(base, p, m)
    part = partition_by_params(GPT(cfg, seed=0).blocks(), schedule=schedule)
    stages = stage_modules(GPT(cfg, seed=0).blocks(), part, rank)
    if tune and not schedule.split_backward:
        raise ValueError(f"{name}: only a split-backward schedule has splits to tune")
    runtime = PipelineRuntime(schedule, stages, _ce, tune_splits=2 if tune else 0)
    first, last = 0 in stages, part.num_stages - 1 in stages
    extra: dict[str, Any] = {}
    if tune:
        while runtime.split_tuning is None:
            runtime.step(idx if first else None, targets if last else None)
            for module in stages.values():
                module.zero_grad(set_to_none=True)
        extra = _tuned(runtime.split_tuning, schedule)
    opt = torch.optim.SGD([q for s in stages.values() for q in s.parameters()], lr=lr)
    timelines: list[tuple[TimedAction, ...]] = []

    def step() -> float | None:
        opt.zero_grad(set_to_none=True)
        result = runtime.step(idx if first else None, targets if last else None)
        opt.step()
        timelines.append(result.timeline)
        return result.loss

    return _Side(step, part, runtime, timelines, extra)


_TUNED = ("tuned_form", "tuning_step_s", "splits_kept", "fitted_costs_s")


def _tuned(tuning: SplitTuner, built: Schedule) -> dict[str, Any]:
    """What `tune_splits` measured and kept, for the bench's line."""
    costs = tuning.costs
    assert costs is not None
    fitted = {k: round(getattr(costs, k), 5) for k in ("f", "b", "w", "split")}
    fitted["stage_scale"] = [round(x, 3) for x in costs.stage_scale]
    return {
        "tuned_form": tuning.form,
        "tuning_step_s": {form: round(t, 4) for form, t in tuning.step_seconds.items()},
        "splits_kept": f"{len(tuning.chosen.split_units())} of {len(built.split_units())}",
        "fitted_costs_s": fitted,
    }


def _ideal(side: _Side, first: int, count: int) -> float:
    """The median over steps ``first`` .. ``first + count - 1`` of the side's `replay`: each
    step's critical path with its own compute times and instant messages (collective)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, side.timelines[first : first + count])
    steps = zip(*every, strict=True)
    return statistics.median(replay(side.runtime.schedule, rows) for rows in steps)


def _alternate(
    rank: int, ours: str, theirs: str, steps: dict[str, Callable[[], float | None]], warmup: int, iters: int,
    folder: str | None, prof_steps: int, extra: dict[str, Any],
) -> dict[str, Any]:
    """Alternate the systems' steps (ABBA), each from a barrier; then profile each if asked."""
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in steps}
    final: dict[str, float | None] = {}
    order = list(steps.items())
    for i in range(warmup + iters):
        for system, step in order if i % 2 == 0 else order[::-1]:  # ABBA: no side always goes first
            dist.barrier()
            t0 = time.perf_counter()
            final[system] = step()
            t1 = time.perf_counter()
            if i >= warmup:
                times[system].append((t0, t1))
    out: dict[str, Any] = {"times": times, "final": final, **extra}
    if folder is not None:
        for system, step in order:
            trace = f"{folder}/{ours}-vs-{theirs.replace(':', '-')}-{system}-rank{rank}.json"
            b = profile_steps(step, prof_steps, trace, before=dist.barrier)
            out[system] = {"breakdown": b.as_record(), "breakdown_trace": trace}
    return out


def bench_gpt(
    cfg: GPTConfig, m: int, mb: int, warmup: int, iters: int, lr: float, only: list[str],
    folder: str | None = None, prof_steps: int = 3,
) -> list[dict[str, Any]]:
    pairs = [
        ("gpipe", "ScheduleGPipe"),
        ("1f1b", "Schedule1F1B"),
        ("zb-h1", "Schedule1F1B"),
        ("zb-h1", "ScheduleInterleavedZeroBubble"),
        ("zb-h1+tune", "Schedule1F1B"),
        ("interleaved-1f1b", "ScheduleInterleaved1F1B"),
        ("zbv", "ScheduleZBVZeroBubble"),
        ("zbv", "ScheduleInterleavedZeroBubble"),
        ("zbv+tune", "ScheduleZBVZeroBubble"),
        # the zero-bubble goal: at least as fast as Tessera's own 1F1B, step for step; first
        # 1F1B against itself, the noise floor of such a pair (two runtimes, one schedule)
        ("1f1b", "tessera:1f1b"),
        ("zb-h1", "tessera:1f1b"),
        ("zb-h1+tune", "tessera:1f1b"),
        ("zbv", "tessera:1f1b"),
        ("zbv+tune", "tessera:1f1b"),
    ]
    tokens = m * mb * cfg.seq_len
    records = []
    with WorkerPool(2, timeout=900) as pool:
        single = pool.run(_gpt_single, cfg, m, mb, warmup, iters, lr, folder, prof_steps)[0]
        extra: dict[str, Any] = {k: single[k] for k in ("breakdown", "breakdown_trace") if k in single}
        records.append({
            "bench": "pipeline",
            "system": "torch-single",
            "config": f"gpt L{cfg.n_layers} d{cfg.d_model} seq{cfg.seq_len} vocab{cfg.vocab_size} "
            f"one process, batch {m * mb} in one pass, sgd",
            "step_time_s": round(single["median"], 4),
            "tokens_per_s": round(tokens / single["median"], 1),
            "final_loss": round(single["final"], 6),
            "ratio_vs_peer": None,
            **extra,
        })
        for ours, theirs in pairs:
            if only and ours not in only:
                continue
            per_rank = pool.run(_gpt_pair, ours, theirs, cfg, m, mb, warmup, iters, lr, folder, prof_steps)
            v = schedule_spec(ours.partition("+")[0]).chunks()
            config = (
                f"gpt L{cfg.n_layers} d{cfg.d_model} seq{cfg.seq_len} vocab{cfg.vocab_size} p=2 v={v} m={m} "
                f"mb={mb} sgd: tessera {ours} vs {theirs if ':' in theirs else 'torch ' + theirs}"
            )
            peer = per_rank[0]["peer"]
            medians, finals, steps = {}, {}, {}
            for system in ("tessera", peer):
                spans = zip(*(r["times"][system] for r in per_rank), strict=True)
                steps[system] = [max(t1 for _, t1 in step) - min(t0 for t0, _ in step) for step in spans]
                medians[system] = statistics.median(steps[system])
                finals[system] = next(f for r in per_rank if (f := r["final"][system]) is not None)
            gap = abs(finals["tessera"] - finals[peer])
            match = gap <= 1e-4 * max(1.0, abs(finals["tessera"]))
            for system in ("tessera", peer):
                records.append({
                    "bench": "pipeline",
                    "system": system,
                    "config": config,
                    "step_time_s": round(medians[system], 4),
                    "tokens_per_s": round(tokens / medians[system], 1),
                    "final_loss": round(finals[system], 6),
                    "ratio_vs_peer": round(medians[peer] / medians["tessera"], 3)
                    if system == "tessera" else None,
                    "loss_match": match if system == "tessera" else None,
                    # back-to-back steps of the two systems see the same load: their ratio's median
                    "ratio_paired_median": round(statistics.median(
                        b / a for a, b in zip(steps["tessera"], steps[peer], strict=True)
                    ), 3) if system == "tessera" else None,
                    "speedup_vs_single": round(single["median"] / medians[system], 3),
                    **_vs_ideal(per_rank[0]["ideal"], system, medians[system], ours, theirs),
                    **{k: per_rank[0][k] for k in _TUNED if system == "tessera" and k in per_rank[0]},
                    **{k: per_rank[0][system][k] for k in ("breakdown", "breakdown_trace")
                       if system in per_rank[0]},
                })
    return records


# Tessera's schedules and torch's of the same name: torch's line gets Tessera's ideal
_SAME = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zbv": "ScheduleZBVZeroBubble"}


def _vs_ideal(ideal: dict[str, float], system: str, median: float, ours: str, theirs: str) -> dict[str, Any]:
    """A Tessera line's ideal step (`replay` of its timed steps: their critical path with
    instant messages) and the median step over it; torch's line against the ideal of
    Tessera's schedule where torch runs the same one (the same modules on the same
    partition), else nothing."""
    if system in ideal:
        seconds = ideal[system]
    elif _SAME.get(ours) == theirs:
        seconds = ideal["tessera"]
    else:
        return {}
    return {"ideal_step_s": round(seconds, 4), "vs_ideal": round(median / seconds, 3)}


def _write_breakdown(records: list[dict[str, Any]], folder: str) -> None:
    bars = {}
    for rec in records:
        b = {k: v for k, v in rec["breakdown"].items() if k != "fractions"}
        label = rec["system"] if rec["system"] == "torch-single" else (
            f"{rec['system']}\n{rec['config'].split(': ')[1].replace(' vs torch ', ' / ')}"
        )
        bars[label] = Breakdown(**b)
    plot(bars, f"{folder}/breakdown.png", "pipeline p=2 m=8, one step of rank 0 (torch.profiler)")
    with open(f"{folder}/results.jsonl", "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--part", choices=["all", "bubble", "gpt"], default="all")
    parser.add_argument("--schedules", nargs="*", default=[], help="only these Tessera schedules")
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    parser.add_argument("--bubble-steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=9)
    add_breakdown_args(parser, "pipeline", "each gpt system")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    records = []
    if args.part in ("all", "bubble"):
        records += bench_bubble(args.sleep_ms, args.bubble_steps, args.schedules)
    if args.part in ("all", "gpt"):
        cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                        n_heads=args.heads, n_layers=args.layers)
        folder = breakdown_folder(args, "pipeline")
        gpt = bench_gpt(cfg, 8, args.microbatch, args.warmup, args.iters, 0.1, args.schedules, folder,
                        args.breakdown_steps)
        records += gpt
        if folder is not None:
            _write_breakdown(gpt, folder)
    for rec in records:
        emit(rec)
    keys = ("system", "config", "step_time_s", "ratio_vs_peer", "ratio_paired_median", "bubble_measured",
            "bubble_simulated")
    table(records, (*keys, "final_loss"))


if __name__ == "__main__":
    main()
