"""A mixture-of-experts GPT on 2 gloo ranks (``--world``): its experts split over the ranks
(expert parallelism, ``ep = world``) beside the same model with every expert on every rank
(data parallelism, ``ep = 1``), in one run on the same batches; and the all-to-all bytes
``CommMeter`` measures beside the formulas.

The model is the main job's (``tessera.launcher.job.moe_model.moe_gpt``: the reference GPT with
a ``tessera.moe.MoE`` of SwiGLU experts as each layer's MLP, router losses attached). Both
systems are ``boost()`` engines on the same model and global batch, AdamW, ZeRO-1, one
microbatch, differing only in ``parallel.ep`` (``world`` or 1), so the difference is expert
parallelism alone. Steps alternate between the systems (ABBA), so background load hits both
alike; the step time is the slowest rank's median.

Per step and rank, the measured all-to-all bytes (``CommMeter.sent_bytes`` of the step's
all-to-alls) are set beside ``exact``: the moe README's count from the step's own routing
(per layer, the counts ``8 * (E - E / ep)``, then ``4 * d`` bytes for each row sent to
another rank's expert and each row returned to another rank, and the same rows' gradients
backward), and ``planner``: ``tessera.planner.experts.all_to_all_bytes`` with evenly spread
routing (dispatch rows and counts; combine as many rows; the backward both again).

``deepspeed-moe``: the same GPT with ``deepspeed.moe.layer.MoE`` layers (the same experts,
top-k, capacity and expert parallelism over every rank; ZeRO-1, AdamW, gloo;
``_moe_deepspeed.py``), run after the Tessera engines on the same batches in DeepSpeed's own
Python (``peers.peer_python``: ``benchmarks/out/peers/deepspeed``, made on first use, or
``--deepspeed-python``); ``ratio_vs_deepspeed`` on the ep line is its step time over
Tessera's. When it cannot run, its row says "not available" with the reason. A "token" is
one sequence position of the global batch.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import emit, peak_rss_mb, table
from _memory_peers import deepspeed_version
from peers import peer_python, run_peer_ranks

from tessera.comm import CommMeter, CommOp
from tessera.comm.testing import WorkerPool
from tessera.launcher import BoostConfig, Engine, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.config.main_config import MoEConfig
from tessera.launcher.job.moe_model import moe_gpt
from tessera.models import GPTConfig
from tessera.moe import MoE, set_aux_grad_scale
from tessera.planner.experts import ExpertShape, all_to_all_bytes
from tessera.zero import Precision

SYSTEMS = ("tessera-ep", "tessera-dp")


def _engine(args: argparse.Namespace, ep: int) -> tuple[Engine, list[MoE]]:
    cfg = GPTConfig(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.mlp_ratio)
    moe = MoEConfig(
        enabled=True,
        experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        dropless=args.dropless,
        expert_hidden=args.expert_hidden,
        shared_hidden=args.shared_hidden,
    )
    model = moe_gpt(cfg, moe, seed=0)
    config = BoostConfig(
        parallel=ParallelConfig(dp=dist.get_world_size(), ep=ep, microbatches=1),
        zero=ZeroConfig(stage=1),
        train=TrainConfig(precision=Precision.FP32),
    )
    engine = boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    set_aux_grad_scale(engine.module, engine.zero.loss_scale)  # one microbatch
    return engine, [m for m in engine.module.modules() if isinstance(m, MoE)]


def _exact(layers: list[MoE], d: int, world: int, rank: int, kept: list[list[torch.Tensor]]) -> int:
    """The README's count for this rank: every layer's counts, the rows it sends to other ranks'
    experts and returns to other ranks, forward and backward (``kept``: each rank's kept
    assignments per expert, per layer)."""
    total = 0
    for i, layer in enumerate(layers):
        local = layer.num_experts // world
        to = [
            [int(kept[q][i][j * local : (j + 1) * local].sum()) for j in range(world)] for q in range(world)
        ]
        sent = sum(to[rank][j] for j in range(world) if j != rank)
        served = sum(to[q][rank] for q in range(world) if q != rank)
        total += 8 * (layer.num_experts - local) + 2 * 4 * d * (sent + served)
    return total


def _bench(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    systems = {name: _engine(args, world if name == "tessera-ep" else 1) for name in SYSTEMS}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    measured: dict[str, list[int]] = {name: [] for name in SYSTEMS}
    exact: list[int] = []
    routed: dict[str, list[torch.Tensor]] = {name: [] for name in SYSTEMS}  # per step: [layer, E]
    losses: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for i in range(args.warmup + args.iters):
        for name in SYSTEMS if i % 2 == 0 else tuple(reversed(SYSTEMS)):
            engine, layers = systems[name]
            dist.barrier()
            with CommMeter() as meter:
                t0 = time.perf_counter()
                out = engine.train_step(*batch(i))
                elapsed = time.perf_counter() - t0
            losses[name].append(out.loss)
            routed[name].append(torch.stack([layer.stats.routed for layer in layers]))
            if i < args.warmup:
                continue
            times[name].append(elapsed)
            measured[name].append(sum(r.sent_bytes for r in meter.records if r.op is CommOp.ALL_TO_ALL))
            if name == "tessera-ep":
                kept = [layer.stats.kept.clone() for layer in layers]
                everyone: list[list[torch.Tensor]] = [[] for _ in range(world)]
                dist.all_gather_object(everyone, kept)
                exact.append(_exact(layers, args.d_model, world, rank, everyone))
    held = {
        name: sum(p.numel() * p.element_size() for p in e.module.parameters())
        for name, (e, _) in systems.items()
    }
    for engine, _ in systems.values():
        engine.close()
    same = [bool(torch.equal(a, b)) for a, b in zip(*routed.values(), strict=True)]
    return {
        "same_routing": same,
        "times": {n: statistics.median(t) for n, t in times.items()},
        "a2a": measured,
        "exact": exact,
        "loss": losses,
        "param_bytes": held,
        "rss": peak_rss_mb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dropless", action="store_true", help="keep every assignment (no capacity)")
    parser.add_argument("--expert-hidden", type=int, default=0, help="each expert's width (0: mlp_ratio * d)")
    parser.add_argument("--shared-hidden", type=int, default=0, help="a shared expert's width (0: none)")
    parser.add_argument(
        "--preset",
        choices=("deepseek",),
        default=None,
        help="deepseek: 16 experts of width d, top-4, a shared expert of width d, drop-less",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument(
        "--deepspeed-python",
        default=None,
        help="a Python with DeepSpeed (default: benchmarks/out/peers/deepspeed, made if missing)",
    )
    args = parser.parse_args()
    if args.preset == "deepseek":  # many narrow experts and a shared one (DeepSeek-MoE's layout)
        args.experts, args.top_k, args.dropless = 16, 4, True
        args.expert_hidden = args.shared_hidden = args.d_model
    args.expert_hidden = args.expert_hidden or args.mlp_ratio * args.d_model
    logging.basicConfig(level=logging.WARNING)
    if args.batch % args.world or args.experts % args.world:
        raise SystemExit(
            f"--batch {args.batch} and --experts {args.experts} must divide by --world {args.world}"
        )
    with WorkerPool(args.world, timeout=1200) as pool:
        results = pool.run(_bench, args, timeout=1200)
    tokens = args.batch * args.seq
    moe = ExpertShape(
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.expert_hidden,
        shared_hidden=args.shared_hidden,
        capacity_factor=None if args.dropless else args.capacity_factor,
    )
    per_rank = tokens // args.world
    counts = 8 * (args.experts - args.experts // args.world)
    dispatch = all_to_all_bytes(moe, per_rank, args.d_model, ep=args.world)  # rows and counts
    planner = args.layers * (4 * (dispatch - counts) + counts)  # combine, and both backward
    config = (
        f"world={args.world} d={args.d_model} layers={args.layers} "
        f"experts={args.experts}x{args.expert_hidden} "
        f"shared={args.shared_hidden} top_k={args.top_k} "
        f"capacity={'dropless' if args.dropless else f'{args.capacity_factor:g}'} "
        f"batch={args.batch}x{args.seq} fp32 gloo AdamW"
    )
    records = []
    for system in SYSTEMS:
        step = max(r["times"][system] for r in results)  # the slowest rank sets the step
        measured = [statistics.median(r["a2a"][system]) for r in results]
        rec: dict[str, Any] = {
            "bench": "moe",
            "system": system,
            "ep": args.world if system == "tessera-ep" else 1,
            "config": config,
            "step_time_s": round(step, 5),
            "tokens_per_s": round(tokens / step, 1),
            "a2a_sent_bytes_per_rank": measured,
            "param_bytes_per_rank": results[0]["param_bytes"][system],
            "peak_rss_mb": round(max(r["rss"] for r in results), 1),
            "final_loss": round(results[0]["loss"][system][-1], 6),
            "losses": [round(v, 6) for v in results[0]["loss"][system]],
        }
        if system == "tessera-ep":
            rec["a2a_exact_bytes_per_rank"] = [statistics.median(r["exact"]) for r in results]
            rec["a2a_exact_equal"] = all(r["a2a"][system] == r["exact"] for r in results)
            rec["a2a_planner_bytes_per_rank"] = round(planner, 1)
        records.append(rec)
    same = [all(step) for step in zip(*(r["same_routing"] for r in results), strict=True)]
    records[0]["routing_same_as_dp_until_step"] = same.index(False) if False in same else len(same)
    records[0]["ratio_vs_dp"] = round(records[1]["step_time_s"] / records[0]["step_time_s"], 3)
    records.append(_deepspeed(args, config, tokens))
    if records[-1]["step_time_s"]:
        records[0]["ratio_vs_deepspeed"] = round(records[-1]["step_time_s"] / records[0]["step_time_s"], 3)
    for rec in records:
        emit(rec)
    table(records, ("system", "ep", "step_time_s", "tokens_per_s", "ratio_vs_dp", "ratio_vs_deepspeed"))


def _deepspeed(args: argparse.Namespace, config: str, tokens: int) -> dict[str, Any]:
    """The ``deepspeed-moe`` row: ``_moe_deepspeed.py`` on ``args.world`` processes of DeepSpeed's
    Python, or why it did not run."""
    rec: dict[str, Any] = {"bench": "moe", "system": "deepspeed-moe", "ep": args.world, "config": config}
    python = args.deepspeed_python or str(peer_python("deepspeed"))
    version = deepspeed_version(python)
    rec["version"] = version
    if version.startswith("not available"):
        return {**rec, "step_time_s": None, "tokens_per_s": None, "status": version}
    flags = [
        f"--{k}={v}"
        for k, v in {
            "d-model": args.d_model, "heads": args.heads, "layers": args.layers,
            "mlp-ratio": args.mlp_ratio, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
            "experts": args.experts, "top-k": args.top_k, "warmup": args.warmup, "iters": args.iters,
            "capacity-factor": args.capacity_factor, "aux-coef": MoEConfig().aux_loss_coef,
            "expert-hidden": args.expert_hidden, "shared-hidden": args.shared_hidden,
        }.items()
    ] + (["--dropless"] if args.dropless else [])  # fmt: skip
    results = run_peer_ranks(python, "_moe_deepspeed.py", args.world, flags)
    if isinstance(results, str):
        return {**rec, "step_time_s": None, "tokens_per_s": None, "status": results}
    step = max(r["step_s"] for r in results)
    return {
        **rec,
        "step_time_s": round(step, 5),
        "tokens_per_s": round(tokens / step, 1),
        "param_bytes_per_rank": results[0]["param_bytes"],
        "final_loss": round(results[0]["losses"][-1], 6),
        "losses": [round(v, 6) for v in results[0]["losses"]],
    }


if __name__ == "__main__":
    main()
