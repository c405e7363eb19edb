"""The planner against measured runs here, and on paper against Megatron-LM at scale.

Part 1, measured (``--skip-measure`` to leave out): 16 configurations of one reference GPT
at world 2, 4 and 8 (dp, 1D tp with and without Megatron SP, 2D, 2.5D, 3D, context
parallelism ring and Ulysses, pipelines 1F1B/GPipe/ZB-H1, ZeRO 0-3, offload, bf16), each
built by ``boost()`` on a pool of gloo processes (one pool per world size) and trained for
``--warmup`` + ``--iters`` steps, ``--rounds`` times (round after round; ``--cases``
measures a subset). Per configuration, one JSON line:

- ``step_time_s``: median over ``--iters`` steps of the slowest rank, in the fastest round
  (``round_steps_s``: every round's; other work on a shared machine only adds time);
  ``min_step_s``: the fastest step of the slowest rank over every round (the least disturbed
  by other work; the summary line ranks by both, and names the misordered pairs of cases);
  ``cpu_per_rank_s``: the CPU seconds per step a rank's process used in that round (every
  thread; the mean over ranks: with more ranks than cores the step is about this times the
  ranks per core); ``predicted_step_s``:
  the planner's, on the cluster of ``--cluster``: by default this machine as
  ``tessera plan --calibrate`` measures it at the start of the same run (a machine's speed
  drifts from one day to the next; the calibration is printed as a JSON line first), or a
  preset or a cluster TOML;
- ``model_state_bytes``: ``ZeroOptimizer.memory().model_state`` when the last warmup step
  enters ``ZeroOptimizer.step()`` (every backward done; the fullest rank) beside
  ``predicted_model_state_bytes`` (``Estimate.model_state``: the most of any rank, which
  under a pipeline is not always the rank with most device memory);
- ``peak_rss_mb``: the largest growth over the ranks of the resident set (``VmHWM`` reset
  through /proc/self/clear_refs after ``gc`` and ``malloc_trim``, mmap threshold 128 KiB as
  in ``zero.py``; the steps are timed in another build of the engine under the thresholds
  glibc's own adjustment reaches, ``_common.malloc_for_speed``; every code path first runs
  once on a tiny copy of the configuration, so lazy initialisation is not charged) while
  the engine is built and runs its warmup steps, beside the planner's
  ``predicted_peak_mb`` (``MemoryEstimate.resident`` of the fullest rank: model state plus
  the larger of activations with their buffers and the end-of-backward / optimizer-step
  scratch, the host's share, the other pipeline stages' parameters the caller's model keeps,
  or the build of the engine if larger; on this machine host and device are one memory).

Then the Spearman rank correlation of predicted and measured step times, and the share of
pairs whose measured times differ by more than 20% that the planner orders right.

Part 2, on paper: the planner's choice for GPT-3 175B on 1024 A100 80GB (batch 1536) and for
Megatron's 1T model on 3072 A100 (batch 3072), with activation recomputation allowed (as
Megatron used), beside the published figures of Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473): 175B
on 1024 GPUs at 140 TFLOP/s per GPU (Section 5.1; Table 2 runs it at t=8, p=12); 1T with
t=8, p=64 on 3072 GPUs at 163 TFLOP/s per GPU (Table 1). Megatron counts
``F = 96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs per step (with the recompute forward); the
planner's figure is converted to that count.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import sys
import time
from typing import Any

import torch
from _common import cpu_s, emit, malloc_for_rss, malloc_for_speed, rss_baseline, status_kb, table

from tessera.comm.testing import WorkerPool
from tessera.launcher import boost
from tessera.launcher.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig, ZeroConfig
from tessera.launcher.config.auto import estimate_config, model_of, search_config
from tessera.models import GPT, GPTConfig, make_batch
from tessera.pipeline import build_schedule
from tessera.pipeline.tune import tuning_steps
from tessera.planner import PRESETS, Cluster, ModelShape, load_cluster
from tessera.planner.calibrate import calibrate
from tessera.zero.precisions import Precision

MODEL = ModelConfig(vocab_size=256, seq_len=64, d_model=256, n_heads=8, n_layers=4)
BATCH = 16

# (label, parallel, zero stage, offload, precision)
CASES: list[tuple[dict[str, Any], int, bool, str]] = [
    ({"dp": 2}, 0, False, "fp32"),
    ({"dp": 2}, 3, False, "fp32"),
    ({"tp": 2}, 0, False, "fp32"),
    ({"pp": 2, "microbatches": 4}, 0, False, "fp32"),
    ({"cp": 2}, 1, False, "fp32"),
    ({"dp": 4}, 1, False, "bf16"),
    ({"dp": 2, "tp": 2, "sequence_parallel": True}, 1, False, "fp32"),
    ({"tp": 4, "tp_mode": "2d"}, 0, False, "fp32"),
    ({"dp": 2, "pp": 2, "microbatches": 4, "schedule": "gpipe"}, 1, False, "fp32"),
    ({"dp": 2, "cp": 2, "cp_mode": "ulysses"}, 2, False, "fp32"),
    ({"dp": 4}, 2, True, "fp32"),
    ({"dp": 8}, 2, False, "fp32"),
    ({"dp": 2, "pp": 2, "tp": 2, "microbatches": 4}, 1, False, "fp32"),
    ({"tp": 8, "tp_mode": "3d"}, 0, False, "fp32"),
    ({"tp": 8, "tp_mode": "2.5d", "tp_depth": 2}, 0, False, "fp32"),
    ({"dp": 4, "pp": 2, "microbatches": 2, "schedule": "zb-h1"}, 1, False, "fp32"),
]


def _config(parallel: dict[str, Any], stage: int, offload: bool, precision: str) -> Config:
    return Config(
        parallel=ParallelConfig(**{"microbatches": 1, **parallel}),
        zero=ZeroConfig(stage, offload),
        model=MODEL,
        data=DataConfig(batch_size=BATCH),
        train=TrainConfig(precision=Precision(precision)),
    )


# ---------------------------------------------------------------------- one configuration
def _train(rank: int, config: Config, warmup: int, iters: int) -> dict[str, Any]:
    """Memory (``iters == 0``: build and warm up under `malloc_for_rss`) or step times (under
    `malloc_for_speed`). A process measures memory only before it ever times: once the heap
    has grown under the high thresholds, large tensors come from its free chunks again and
    the resident set counts its slack."""
    (malloc_for_speed if iters else malloc_for_rss)()
    tiny = dataclasses.replace(
        config, model=dataclasses.replace(config.model, d_model=64, n_layers=config.parallel.pp)
    )
    _run(tiny, 1, 0)  # every code path once (lazy initialisation) outside the measurement
    return _run(config, warmup, iters)


def _run(config: Config, warmup: int, iters: int) -> dict[str, Any]:
    p = config.parallel
    split = p.pp > 1 and build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages).split_backward
    if iters and split and p.tune_splits:
        warmup += tuning_steps(p.tune_splits)  # time the form the runtime settles on
    m = config.model
    cfg = GPTConfig(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_layers, m.mlp_ratio, m.dropout, True)
    batches = [make_batch(cfg, config.data.batch_size, seed=i) for i in range(warmup + iters)]
    base = rss_baseline()
    model = GPT(cfg, seed=0)
    engine = boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    states: list[int] = []
    step = engine.zero.step

    def metered() -> bool:  # every backward of the step has run: model state at its peak
        states.append(engine.zero.memory().model_state)
        return step()

    engine.zero.step = metered  # type: ignore[method-assign]
    for i in range(warmup):
        engine.train_step(*batches[i])
    rss_mb = (status_kb("VmHWM") - base) / 1024
    engine.zero.step = step  # type: ignore[method-assign]
    times, loss = [], float("nan")
    cpu0 = cpu_s()
    for i in range(warmup, warmup + iters):
        t0 = time.perf_counter()
        loss = engine.train_step(*batches[i]).loss
        times.append(time.perf_counter() - t0)
    cpu = (cpu_s() - cpu0) / max(iters, 1)
    engine.mesh.close()
    return {
        "times": times,
        "cpu_s": cpu,
        "rss_mb": rss_mb,
        "model_state": max(states) if states else 0,
        "loss": loss,
    }


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    if len(xs) < 2:
        return float("nan")  # one configuration (``--cases`` with one index): no order to compare
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    spread = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / spread if spread else float("nan")


def measure(
    cluster: Cluster, warmup: int, iters: int, cases: list[int] | None = None, rounds: int = 1
) -> list[dict[str, Any]]:
    """Part 1: every case (or those of the indices ``cases``) measured and predicted; with
    ``rounds`` > 1 every case runs that many times, round after round, and keeps its fastest
    round's median (other work on the machine only ever adds time)."""
    records: list[dict[str, Any]] = []
    chosen = range(len(CASES)) if cases is None else cases
    configs = {i: _config(*CASES[i]) for i in chosen}
    runs: dict[int, list[list[dict[str, Any]]]] = {i: [] for i in configs}
    memory: dict[int, list[dict[str, Any]]] = {}
    for round_ in range(rounds):
        for world in sorted({c.world_size for c in configs.values()}):
            with WorkerPool(world, timeout=900) as pool:
                here = [(i, c) for i, c in configs.items() if c.world_size == world]
                for case, config in here if round_ == 0 else ():  # memory first (see `_train`)
                    assert config.validate() == [], config.validate()
                    memory[case] = pool.run(_train, config, warmup, 0, timeout=900)
                for case, config in here:
                    runs[case].append(pool.run(_train, config, warmup, iters, timeout=900))
    for case, config in configs.items():
        world = config.world_size

        def median_step(per_rank: list[dict[str, Any]]) -> float:
            slowest = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
            return float(statistics.median(slowest))

        def fastest(per_rank: list[dict[str, Any]]) -> float:
            return float(min(max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)))

        per_rank = min(runs[case], key=median_step)
        step = median_step(per_rank)
        est = estimate_config(config, cluster)
        p = config.parallel
        label = (
            f"dp{p.dp} pp{p.pp} tp{p.tp}/{p.tp_mode}{'+sp' if p.sequence_parallel else ''} "
            f"cp{p.cp}/{p.cp_mode} {p.schedule} m{p.microbatches} z{config.zero.stage}"
            f"{'+off' if config.zero.offload else ''} {config.train.precision}"
        )
        record = {
            "bench": "plan",
            "system": "tessera",
            "config": f"{label} world={world}",
            "case": case,
            "step_time_s": round(step, 5),
            "round_steps_s": [round(median_step(r), 4) for r in runs[case]],
            "min_step_s": round(min(fastest(r) for r in runs[case]), 5),
            "cpu_per_rank_s": round(statistics.fmean(r["cpu_s"] for r in per_rank), 5),
            "predicted_step_s": round(est.time.total, 5),
            "tokens_per_s": round(BATCH * MODEL.seq_len / step, 1),
            "model_state_bytes": max(r["model_state"] for r in memory[case]),
            "predicted_model_state_bytes": round(est.model_state),
            "peak_rss_mb": round(max(r["rss_mb"] for r in memory[case]), 1),
            "predicted_peak_mb": round(est.memory.resident / 2**20, 1),
            "final_loss": round(per_rank[0]["loss"], 4),
        }
        record["state_ratio"] = round(record["predicted_model_state_bytes"] / record["model_state_bytes"], 4)
        record["rss_ratio"] = round(record["predicted_peak_mb"] / max(record["peak_rss_mb"], 1e-9), 3)
        record["time_ratio"] = round(est.time.total / step, 3)
        emit(record)
        records.append(record)
    predicted = [r["predicted_step_s"] for r in records]

    def agreement(measured: list[float]) -> tuple[int, int, list[tuple[int, int]]]:
        pairs, right, wrong = 0, 0, []
        for i in range(len(records)):
            for j in range(i + 1, len(records)):
                a, b = measured[i], measured[j]
                if max(a, b) > 1.2 * min(a, b):
                    pairs += 1
                    if (a < b) == (predicted[i] < predicted[j]):
                        right += 1
                    else:
                        wrong.append((records[i]["case"], records[j]["case"]))
        return pairs, right, wrong

    measured = [r["step_time_s"] for r in records]
    fastest_steps = [r["min_step_s"] for r in records]
    pairs, right, wrong = agreement(measured)
    pairs_min, right_min, wrong_min = agreement(fastest_steps)
    emit(
        {
            "bench": "plan",
            "system": "tessera",
            "config": f"rank agreement over {len(records)} configurations",
            "step_time_s": 0.0,
            "tokens_per_s": 0.0,
            "spearman": round(_spearman(measured, predicted), 3),
            "pairs_over_20pct": pairs,
            "pairs_ordered_right": right,
            "misordered_cases": wrong,
            "spearman_min_step": round(_spearman(fastest_steps, predicted), 3),
            "pairs_over_20pct_min_step": pairs_min,
            "pairs_ordered_right_min_step": right_min,
            "misordered_cases_min_step": wrong_min,
            "model_state_within_5pct": sum(abs(r["state_ratio"] - 1) <= 0.05 for r in records),
            "peak_rss_within_15pct": sum(abs(r["rss_ratio"] - 1) <= 0.15 for r in records),
        }
    )
    return records


# ---------------------------------------------------------------------- part 2: at scale
PAPER = {
    "gpt3-175b": {
        "model": ModelConfig(vocab_size=51200, seq_len=2048, d_model=12288, n_heads=96, n_layers=96),
        "batch": 1536,
        "gpus": 1024,
        "published_tflops": 140.0,
        "published_config": "t=8, p=12 in Table 2 (model-parallel size 96); 1024-GPU run: Section 5.1",
    },
    "megatron-1t": {
        "model": ModelConfig(vocab_size=51200, seq_len=2048, d_model=25600, n_heads=160, n_layers=128),
        "batch": 3072,
        "gpus": 3072,
        "published_tflops": 163.0,
        "published_config": "t=8, p=64, dp=6, interleaved schedule (Table 1)",
        "published_parallel": ParallelConfig(
            dp=6, pp=64, tp=8, schedule="interleaved-1f1b", virtual_stages=2, microbatches=512
        ),
    },
}


def megatron_flops(model: ModelShape) -> float:
    """Megatron-LM's FLOPs per step, equation (3) of the paper (recompute forward included)."""
    b, s, layers, h, v = model.batch, model.seq, model.layers, model.hidden, model.vocab
    return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def at_scale(max_chunks: int) -> None:
    """Part 2: the planner's choice beside Megatron's published configuration and throughput."""
    for name, spec in PAPER.items():
        gpus = int(spec["gpus"])  # type: ignore[call-overload]
        cluster = dataclasses.replace(PRESETS["a100-80g"], nodes=gpus // 8)
        base = Config(
            model=spec["model"],  # type: ignore[arg-type]
            data=DataConfig(batch_size=int(spec["batch"])),  # type: ignore[call-overload]
            train=TrainConfig(precision=Precision.BF16),
        )
        t0 = time.perf_counter()
        result = search_config(
            base, cluster, recompute=(False, True), max_chunks=max_chunks, tp_modes=("1d",)
        )
        seconds = time.perf_counter() - t0
        model = model_of(base)
        best = result.best
        record: dict[str, Any] = {
            "bench": "plan-at-scale",
            "system": "tessera-planner",
            "config": f"{name} on {gpus} A100 80GB (preset a100-80g), batch {model.batch}",
            "search_s": round(seconds, 2),
            "published_tflops_per_gpu": spec["published_tflops"],
            "published_config": spec["published_config"],
        }
        if best is None:
            record.update(step_time_s=0.0, tokens_per_s=0.0, choice="nothing fits")
        else:
            step = best.step_time
            record.update(
                choice=best.label(),
                step_time_s=round(step, 3),
                tokens_per_s=round(model.batch * model.seq / step, 1),
                predicted_tflops_per_gpu_megatron_count=round(megatron_flops(model) / step / gpus / 1e12, 1),
                predicted_model_tflops_per_gpu=round(model.step_flops() / step / gpus / 1e12, 1),
                memory_gib=round(best.estimate.memory.device / 2**30, 1),
                bubble=round(best.estimate.bubble_fraction, 3),
                breakdown_s={
                    k: round(getattr(best.estimate.time, k), 3)
                    for k in ("compute", "tensor_comm", "bubble", "data_comm", "optimizer")
                },
            )
        published = spec.get("published_parallel")
        if isinstance(published, ParallelConfig):
            config = dataclasses.replace(base, parallel=published)
            assert config.validate() == [], config.validate()
            est = estimate_config(config, cluster, recompute=True)
            record["published_config_predicted"] = {
                "step_time_s": round(est.time.total, 3),
                "tflops_per_gpu_megatron_count": round(
                    megatron_flops(model) / est.time.total / gpus / 1e12, 1
                ),
                "memory_gib": round(est.memory.device / 2**30, 1),
                "bubble": round(est.bubble_fraction, 3),
            }
        emit(record)


def _cluster(spec: str) -> Cluster:
    """``spec``'s cluster; ``calibrate``: this machine measured now (one JSON line says how)."""
    if spec != "calibrate":
        return load_cluster(spec)
    t0 = time.perf_counter()
    cluster = calibrate()
    emit(
        {
            "bench": "plan",
            "system": "tessera",
            "config": "calibration of this machine (tessera plan --calibrate)",
            "step_time_s": 0.0,
            "tokens_per_s": 0.0,
            "seconds": round(time.perf_counter() - t0, 1),
            "cluster": dataclasses.asdict(cluster),
        }
    )
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cluster",
        default="calibrate",
        help="preset or cluster TOML for part 1 (default: calibrate this machine first)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of every case; the fastest counts (default 2)"
    )
    parser.add_argument("--skip-measure", action="store_true", help="only the at-scale comparison")
    parser.add_argument("--skip-scale", action="store_true", help="only the measured part")
    parser.add_argument(
        "--cases", default="", help="comma-separated indices into CASES to measure (default: all 16)"
    )
    parser.add_argument("--max-chunks", type=int, default=4, help="interleaved chunks at scale (default 4)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not args.skip_measure:
        cases = [int(i) for i in args.cases.split(",")] if args.cases else None
        cluster = _cluster(args.cluster)
        records = measure(cluster, args.warmup, args.iters, cases, args.rounds)
        table(
            records,
            (
                "config",
                "step_time_s",
                "predicted_step_s",
                "state_ratio",
                "peak_rss_mb",
                "predicted_peak_mb",
                "rss_ratio",
            ),
        )
    if not args.skip_scale:
        at_scale(args.max_chunks)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
