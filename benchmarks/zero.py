"""ZeRO on 2 gloo ranks: Tessera ZeRO-2 beside torch DDP (system "torch-ddp") and Tessera
ZeRO-3 beside FSDP2 ``fully_shard`` (system "torch-fsdp2"), on the same ~50M-parameter
reference GPT, data and AdamW settings, in one run.

- A token is one position of one sequence; ``tokens_per_s`` counts both ranks' tokens.
- ``step_time_s``: median of ``--iters`` steps (forward, backward, optimizer step); the two
  systems of a pair alternate step by step, so load from other processes hits both alike.
- ``peak_rss_mb``: the larger over the ranks of the growth of the resident set while the
  system is built and runs ``--warmup`` steps, over a baseline taken just before (after
  ``gc`` and ``malloc_trim``): ``VmHWM`` of /proc/self/status after resetting it by writing
  "5" to /proc/self/clear_refs. ``peak_rss_mb_per_rank`` lists both ranks. The workers set
  glibc's mmap threshold to 128 KiB (``mallopt``), so large tensors are unmapped when freed
  and the resident set follows the live bytes instead of what the heap happens to retain;
  both systems of a pair run under the same setting. The timed steps run after the
  thresholds are raised to where glibc's own adjustment takes them (32 MiB mmap, 64 MiB
  trim: ``_common.malloc_for_speed``), as in an ordinary process: under 128 KiB every large
  allocation faults its pages in again. Each code path runs once on a tiny
  model first, so lazy initialisation is not charged to whichever system goes first.
- ``model_state_bytes``: parameters + gradients + optimizer state per rank, right after a
  backward (gradients present): ``ZeroOptimizer.memory()`` for Tessera,
  ``measure_memory`` for DDP, the storages of the local shards for FSDP2.
- ``comm_bytes``: bytes per step by the paper accounting. Tessera's are metered by
  ``CommMeter``; DDP's and FSDP2's collectives bypass ``tessera.comm``, so theirs are the
  formulas (DDP: all-reduce of the fp32 gradients, 2 x 4 bytes per parameter; FSDP2: 3 x 4),
  marked ``"comm_source": "formula"``.
- ``torch-single`` (with the first stage run): the same GPT in plain PyTorch in one process
  (rank 0, one thread, while rank 1 waits at a barrier) on one rank's batch (``--batch``
  sequences) per step, AdamW: the work of one data-parallel rank without communication.
  Its tokens/s counts its own tokens; ``scaling_vs_single`` on each line is the line's
  tokens/s over it (2.0 is perfect scaling on 2 ranks, each with its own core).
- ``--breakdown``: after the timed steps, ``--breakdown-steps`` more of each system run under
  torch.profiler on both ranks; rank 0's split of a step into compute / communication / idle
  / overhead (``benchmarks/_breakdown.py``) goes into the line (``breakdown``), the Chrome
  traces and a stacked-bar ``breakdown.png`` into the run folder (``--out``).
- A/B inside one run: ``--vs-stage2`` adds Tessera ZeRO-2 (system "tessera-zero2") to the
  stage-3 pair, so ZeRO-3's ratio to ZeRO-2 (``ratio_vs_zero2``) comes from steps that
  alternate under the same load; ``--variants NAME:KEY=VALUE,...`` adds ZeRO-3 systems
  "tessera-NAME" built with those ``ZeroOptimizer`` options (booleans as 0/1, integers), e.g.
  ``--variants before:keep_for_backward=0,reuse_buffers=0``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _breakdown import Breakdown, add_breakdown_args, breakdown_folder, plot, profile_steps
from _common import emit, malloc_for_rss, malloc_for_speed, rss_baseline, status_kb, table
from _memory_peers import deepspeed_version
from peers import peer_python, run_peer_ranks

from tessera.comm import CommMeter, measure_memory, storage_bytes
from tessera.comm.testing import WorkerPool
from tessera.models import GPT, GPTConfig, make_batch
from tessera.zero import ZeroOptimizer

PAIRS = {1: "torch-ddp", 2: "torch-ddp", 3: "torch-fsdp2"}
DEEPSPEED = "deepspeed-zero"
LR = 1e-4


# ---------------------------------------------------------------------- systems
class System:
    """One training setup on this rank: ``step(i, measure)`` runs step i and returns the loss."""

    model_state = 0
    comm_bytes = 0

    def __init__(self, model: GPT, rank: int, batch: int) -> None:
        self.model, self.rank, self.batch = model, rank, batch

    def data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(self.model.config, self.batch, seed=1000 * i + self.rank)

    def step(self, i: int, measure: bool = False) -> float:
        raise NotImplementedError


class Tessera(System):
    def __init__(self, model: GPT, rank: int, batch: int, stage: int, **options: Any) -> None:
        super().__init__(model, rank, batch)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.zero = ZeroOptimizer(model, opt, stage=stage, bucket_bytes=25 * 2**20, **options)

    def step(self, i: int, measure: bool = False) -> float:
        with CommMeter() as meter:
            loss = self.model.loss(*self.data(i))
            self.zero.backward(loss)
            if measure:
                self.model_state = self.zero.memory().model_state
            self.zero.step()
        if measure:
            self.comm_bytes = meter.volume_bytes
        return loss.item()


class Single(System):
    """Plain PyTorch in one process on one rank's batch: forward, backward, AdamW."""

    def __init__(self, model: GPT, rank: int, batch: int) -> None:
        super().__init__(model, rank, batch)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def loss(self, i: int) -> torch.Tensor:
        return self.model.loss(*self.data(i))

    def step(self, i: int, measure: bool = False) -> float:
        loss = self.loss(i)
        torch.autograd.backward(loss)
        if measure:
            self.model_state = measure_memory(modules=[self.model], optimizers=[self.opt]).model_state
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class DDP(Single):
    """torch DDP over the same model: Single's step, the forward through the DDP wrapper."""

    def __init__(self, model: GPT, rank: int, batch: int) -> None:
        super().__init__(model, rank, batch)
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(model)
        self.comm_bytes = 2 * 4 * sum(p.numel() for p in model.parameters())

    def loss(self, i: int) -> torch.Tensor:
        idx, targets = self.data(i)
        return F.cross_entropy(self.ddp(idx).flatten(0, -2), targets.flatten())


class FSDP2(System):
    def __init__(self, model: GPT, rank: int, batch: int) -> None:
        super().__init__(model, rank, batch)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.comm_bytes = 3 * 4 * sum(p.numel() for p in model.parameters())
        self._local: Callable[[Any], torch.Tensor] = lambda t: t.to_local() if isinstance(t, DTensor) else t

    def step(self, i: int, measure: bool = False) -> float:
        loss = self.model.loss(*self.data(i))
        torch.autograd.backward(loss)
        if measure:
            params = [self._local(p) for p in self.model.parameters()]
            grads = [self._local(p.grad) for p in self.model.parameters() if p.grad is not None]
            state = [self._local(v) for s in self.opt.state.values() for v in s.values()]
            self.model_state = storage_bytes(params) + storage_bytes(grads) + storage_bytes(state)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


SINGLE = "torch-single"
ZERO2 = "tessera-zero2"
Variants = dict[str, dict[str, int]]


def _parse_variant(text: str) -> tuple[str, dict[str, int]]:
    name, _, spec = text.partition(":")
    options = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value)
    return f"tessera-{name}", options


def _build(
    name: str, stage: int, cfg: GPTConfig, rank: int, batch: int, variants: Variants | None = None
) -> System:
    model = GPT(cfg, seed=0)
    if name == "tessera":
        return Tessera(model, rank, batch, stage)
    if name == ZERO2:
        return Tessera(model, rank, batch, 2)
    if variants and name in variants:
        return Tessera(model, rank, batch, stage, **variants[name])
    if name == SINGLE:
        return Single(model, rank, batch)
    return DDP(model, rank, batch) if name == "torch-ddp" else FSDP2(model, rank, batch)


def _step(name: str, system: System, i: int, measure: bool = False) -> float | None:
    """One step; the single-process system steps on rank 0 only, then every rank meets at a
    barrier (outside the timing of the others)."""
    if name != SINGLE:
        return system.step(i, measure)
    loss = system.step(i, measure) if dist.get_rank() == 0 else None
    dist.barrier()
    return loss


def _pair(
    rank: int,
    stage: int,
    cfg: GPTConfig,
    batch: int,
    warmup: int,
    iters: int,
    single: bool,
    folder: str | None,
    prof_steps: int,
    extras: tuple[str, ...] = (),
    variants: Variants | None = None,
) -> dict[str, Any]:
    names = ("tessera", PAIRS[stage], *extras, *((SINGLE,) if single else ()))
    malloc_for_rss()  # see the module docstring
    tiny = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    for name in names:  # first use of each code path (lazy initialisation) outside the measurements
        _step(name, _build(name, stage, tiny, rank, 1, variants), 0)
    systems: dict[str, System] = {}
    out: dict[str, dict[str, Any]] = {}
    for name in names:  # one at a time: resident-memory growth over a fresh baseline
        base = rss_baseline()
        system = _build(name, stage, cfg, rank, batch, variants)
        for i in range(warmup):
            _step(name, system, i, measure=i == warmup - 1)
        out[name] = {
            "peak_rss_mb": (status_kb("VmHWM") - base) / 1024,
            "model_state_bytes": system.model_state,
            "comm_bytes": system.comm_bytes,
        }
        systems[name] = system
    times: dict[str, list[float]] = {n: [] for n in names}
    malloc_for_speed()  # see the module docstring
    for i in range(warmup, warmup + iters):  # alternate, so both see the same background load
        for name in names:
            t0 = time.perf_counter()
            out[name]["final_loss"] = _step(name, systems[name], i)
            times[name].append(time.perf_counter() - t0)
    for name in names:
        out[name]["step_time_s"] = sorted(times[name])[len(times[name]) // 2]
    if folder is not None:
        for name in names:
            if name == SINGLE and rank != 0:
                continue
            trace = f"{folder}/stage{stage}-{name}-rank{rank}.json"
            step = functools.partial(systems[name].step, warmup + iters)
            b = profile_steps(step, prof_steps, trace)
            out[name] |= {"breakdown": b.as_record(), "breakdown_trace": trace}
        dist.barrier()
    out["psi"] = {"n": sum(p.numel() for p in systems["tessera"].model.parameters())}
    return out


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    parser.add_argument(
        "--deepspeed", action="store_true", help="add DeepSpeed ZeRO at each stage (its own Python)"
    )
    parser.add_argument("--deepspeed-python", default=None, help="an interpreter with deepspeed")
    add_breakdown_args(parser, "zero", "each system")
    parser.add_argument("--vs-stage2", action="store_true", help="add Tessera ZeRO-2 to the stage-3 pair")
    parser.add_argument("--variants", nargs="*", default=[], help="NAME:KEY=VALUE,... ZeRO-3 variants")
    args = parser.parse_args()
    variants = dict(_parse_variant(v) for v in args.variants)
    logging.basicConfig(level=logging.WARNING)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
    )
    world = 2
    records: list[dict[str, Any]] = []
    folder = breakdown_folder(args, "zero")
    for stage in args.stages:
        single = stage == args.stages[0]
        extras = (*(variants if stage == 3 else ()), *((ZERO2,) if stage == 3 and args.vs_stage2 else ()))
        # fresh processes per stage: memory is measured before the process ever timed steps
        # (`_common.malloc_for_rss`: a heap grown under malloc_for_speed serves large tensors again)
        with WorkerPool(world, timeout=900) as pool:
            per_rank = pool.run(
                _pair,
                stage,
                cfg,
                args.batch,
                args.warmup,
                args.iters,
                single,
                folder,
                args.breakdown_steps,
                extras,
                variants,
            )
        psi = per_rank[0]["psi"]["n"]
        config = (
            f"stage={stage} gpt {psi / 1e6:.1f}M d={cfg.d_model} L={cfg.n_layers} V={cfg.vocab_size} "
            f"seq={cfg.seq_len} batch={args.batch}/rank world={world} AdamW fp32 gloo"
        )
        tokens = world * args.batch * cfg.seq_len
        pair = []
        labels = {
            SINGLE: config.replace(f"stage={stage}", "stage=none").replace(f"world={world}", "world=1"),
            ZERO2: config.replace(f"stage={stage}", "stage=2"),
        }
        for name in ("tessera", PAIRS[stage], *extras, *((SINGLE,) if single else ())):
            ranks = per_rank[:1] if name == SINGLE else per_rank
            step_time = max(r[name]["step_time_s"] for r in ranks)
            rss = [round(r[name]["peak_rss_mb"], 1) for r in ranks]
            pair.append(
                {
                    "bench": "zero",
                    "system": name,
                    "config": labels.get(name, config),
                    "step_time_s": round(step_time, 4),
                    "tokens_per_s": round((tokens // world if name == SINGLE else tokens) / step_time, 1),
                    "peak_rss_mb": max(rss),
                    "peak_rss_mb_per_rank": rss,
                    "model_state_bytes": max(r[name]["model_state_bytes"] for r in per_rank),
                    "comm_bytes": per_rank[0][name]["comm_bytes"],
                    "comm_source": {"tessera": "CommMeter", SINGLE: None}.get(name, "formula"),
                    "final_loss": round(sum(r[name]["final_loss"] for r in ranks) / len(ranks), 5),
                    "ratio_vs_peer": None,
                }
            )
            if "breakdown" in per_rank[0][name]:
                pair[-1] |= {k: per_rank[0][name][k] for k in ("breakdown", "breakdown_trace")}
        ours, peer = pair[:2]
        for rec in pair:
            if rec["system"].startswith("tessera") and rec["system"] != ZERO2:
                rec["ratio_vs_peer"] = round(peer["step_time_s"] / rec["step_time_s"], 3)
        zero2 = next((r for r in pair if r["system"] == ZERO2), None)
        for rec in pair:
            if zero2 is not None and rec["system"].startswith("tessera") and rec is not zero2:
                rec["ratio_vs_zero2"] = round(zero2["step_time_s"] / rec["step_time_s"], 3)
        ours["memory_ratio_vs_peer"] = round(ours["model_state_bytes"] / peer["model_state_bytes"], 3)
        ours["rss_ratio_vs_peer"] = round(ours["peak_rss_mb"] / max(peer["peak_rss_mb"], 1e-9), 3)
        if args.deepspeed:
            pair.append(_deepspeed(args, stage, cfg, config, tokens))
            if pair[-1]["step_time_s"]:
                ours["ratio_vs_deepspeed"] = round(pair[-1]["step_time_s"] / ours["step_time_s"], 3)
        records += pair
    single_tps = next((r["tokens_per_s"] for r in records if r["system"] == SINGLE), None)
    for rec in records:
        tps = rec["tokens_per_s"]
        rec["scaling_vs_single"] = round(tps / single_tps, 3) if single_tps and tps else None
        emit(rec)
    if folder is not None:
        bars = {}
        for rec in (r for r in records if "breakdown" in r):  # not DeepSpeed's: another process
            b = {k: v for k, v in rec["breakdown"].items() if k != "fractions"}
            bars[f"{rec['system']}\nstage {rec['config'].split()[0].split('=')[1]}"] = Breakdown(**b)
        plot(bars, f"{folder}/breakdown.png", "ZeRO on 2 ranks, one step of rank 0 (torch.profiler)")
        with open(f"{folder}/results.jsonl", "w") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in records)
    table(
        records,
        (
            "system",
            "step_time_s",
            "peak_rss_mb",
            "model_state_bytes",
            "comm_bytes",
            "ratio_vs_peer",
            "ratio_vs_zero2",
            "ratio_vs_deepspeed",
        ),
    )


def _deepspeed(
    args: argparse.Namespace, stage: int, cfg: GPTConfig, config: str, tokens: int
) -> dict[str, Any]:
    """The ``deepspeed-zero`` row of ``stage``: ``_zero_deepspeed.py`` on 2 processes of
    DeepSpeed's Python, after the pair, on the same batches; or why it did not run."""
    rec: dict[str, Any] = {"bench": "zero", "system": DEEPSPEED, "config": config}
    python = args.deepspeed_python or str(peer_python("deepspeed"))
    rec["version"] = deepspeed_version(python)
    if rec["version"].startswith("not available"):
        return {**rec, "step_time_s": None, "tokens_per_s": None, "status": rec["version"]}
    flags = {
        "world": 2, "stage": stage, "d-model": cfg.d_model, "heads": cfg.n_heads, "layers": cfg.n_layers,
        "vocab": cfg.vocab_size,
        "seq": cfg.seq_len, "batch": args.batch, "warmup": args.warmup, "iters": args.iters, "lr": LR,
    }  # fmt: skip
    results = run_peer_ranks(python, "_zero_deepspeed.py", 2, [f"--{k}={v}" for k, v in flags.items()])
    if isinstance(results, str):
        return {**rec, "step_time_s": None, "tokens_per_s": None, "status": results}
    step = max(r["step_s"] for r in results)
    losses = [sum(r["losses"][-1] for r in results) / len(results)]
    return {**rec, "step_time_s": round(step, 4), "tokens_per_s": round(tokens / step, 1),
            "final_loss": round(losses[0], 5)}  # fmt: skip


if __name__ == "__main__":
    main()
