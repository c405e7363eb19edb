"""Tensor parallelism on 2 gloo ranks: Tessera's ``parallelize`` beside torch's DTensor
``parallelize_module`` (system "torch-dtensor"), on the same reference GPT, data and AdamW
settings, in one run.

Two plans, each run by both systems:

- ``blocks``: q/k/v/fc_in column-parallel and out_proj/fc_out row-parallel (torch's
  ``ColwiseParallel`` / ``RowwiseParallel``); embedding and LM head replicated, the loss
  ``F.cross_entropy`` on full logits.
- ``full``: also the token embedding split over the vocabulary (Tessera ``vocab``; torch
  ``RowwiseParallel`` on the embedding) and the LM head over the vocabulary with the loss
  computed from sharded logits (Tessera ``vocab_parallel_cross_entropy``; torch
  ``ColwiseParallel(use_local_output=False)`` under ``loss_parallel()``).

A third Tessera line runs the ``full`` plan with sequence parallelism (no DTensor peer here),
a fourth the ``full`` plan without the overlapped region entry (``full-no-overlap``:
``set_overlap(model, False)``, so each input-gradient all-reduce runs after the weight
gradients instead of beside them): the A/B of that overlap within the run.
A ``torch-single`` line runs the same GPT in plain PyTorch in one process (rank 0, one
thread, while rank 1 waits at a barrier): the same work as the whole tp job, since both tp
ranks read the same batch; ``speedup_vs_single`` on each line is its tokens/s over that one's.
A ``torch-ddp`` line runs data parallelism on the same two ranks (DDP, each rank its own
batch of ``--batch`` rows, so twice the tokens per step; its bytes are the formula, an
all-reduce of the fp32 gradients); ``vs_dp`` on each line is its tokens/s over DDP's.

``--breakdown``: after the timed steps, ``--breakdown-steps`` more of each system run under
torch.profiler on both ranks; rank 0's split of a step into compute / communication / idle /
overhead (``benchmarks/_breakdown.py``) goes into the line (``breakdown``), the Chrome trace
of each rank and a stacked-bar ``breakdown.png`` into the run folder (``--out``).

- Both ranks of the tp group read the same batch; a token is one position of one sequence,
  so ``tokens_per_s`` = batch * seq / step time.
- ``step_time_s``: median of ``--iters`` steps (forward, backward, AdamW step); the systems
  alternate step by step so background load hits them alike; the slower rank counts.
- ``comm_bytes``: bytes per step per rank, paper accounting (all-reduce of S = 2S,
  all-gather its output, reduce-scatter its input). Tessera's from ``CommMeter``. DTensor's
  collectives bypass ``tessera.comm``: they are counted by a ``TorchDispatchMode`` over
  torch's functional collectives (``_c10d_functional`` all_reduce, all_gather_into_tensor,
  reduce_scatter_tensor, all_to_all_single) with the same accounting, marked
  ``"comm_source": "dispatch"``; ``comm_counts`` gives ``CommDebugMode``'s op counts too.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _breakdown import add_breakdown_args, breakdown_folder, plot, profile_steps
from _common import add_gpt_args, emit, gpt_config, table
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.comm import CommMeter, Mesh, Topology
from tessera.comm.testing import WorkerPool
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import (
    GPT_PLAN,
    Plan,
    parallel_gpt_loss,
    parallelize,
    set_overlap,
    sync_sequence_parallel_grads,
)

ADAMW = {"lr": 1e-4, "weight_decay": 0.1}
BLOCKS_PLAN = Plan.of(
    {p: s for p, s in GPT_PLAN.entries if p.startswith("layers.")}, name="tessera-gpt-blocks"
)
RUNS = (("blocks", "tessera"), ("blocks", "torch-dtensor"), ("full", "tessera"), ("full", "torch-dtensor"))
SP_RUN = ("full+sp", "tessera")
NO_OVERLAP_RUN = ("full-no-overlap", "tessera")
CHUNKS_RUN = ("full-chunks2", "tessera")


class _FunctionalCollectiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes of torch's functional collectives (what DTensor runs), paper accounting."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.volume = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = str(getattr(func, "_schema", "")).split("(")[0]
        if packet.startswith("_c10d_functional::"):
            x = args[0]
            if "all_gather_into_tensor" in packet:
                self.volume += x.numel() * x.element_size() * int(args[1])
            elif "reduce_scatter_tensor" in packet or "all_to_all_single" in packet:
                self.volume += x.numel() * x.element_size()
            elif "all_reduce" in packet:
                self.volume += 2 * x.numel() * x.element_size()
        return func(*args, **(kwargs or {}))


class System:
    """One tp setup on this rank: ``step(i)`` runs training step i and returns the loss."""

    comm_bytes = 0
    comm_counts: dict[str, int] | None = None

    def __init__(self, cfg: GPTConfig, batch: int) -> None:
        self.cfg, self.batch = cfg, batch

    def data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(self.cfg, self.batch, seed=1000 + i)  # the same batch on both tp ranks

    def step(self, i: int, measure: bool = False) -> float:
        raise NotImplementedError


class Tessera(System):
    def __init__(self, cfg: GPTConfig, batch: int, plan: str, mesh: Mesh) -> None:
        super().__init__(cfg, batch)
        self.sp = plan.endswith("+sp")
        self.full = plan.startswith("full")
        self.group = mesh.group("tp")
        self.model = parallelize(
            GPT(cfg, seed=0),
            plan=GPT_PLAN if self.full else BLOCKS_PLAN,
            mesh=mesh,
            sequence_parallel=self.sp,
        )
        set_overlap(self.model, not plan.endswith("no-overlap"), chunks=2 if plan.endswith("chunks2") else 1)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)  # type: ignore[arg-type]

    def step(self, i: int, measure: bool = False) -> float:
        idx, targets = self.data(i)
        with CommMeter() as meter:
            if self.full:
                loss = parallel_gpt_loss(self.model, idx, targets, self.group)
            else:
                loss = F.cross_entropy(self.model(idx).flatten(0, -2), targets.flatten())
            torch.autograd.backward(loss)
            if self.sp:
                sync_sequence_parallel_grads(self.model, self.group)
        self.opt.step()
        self.opt.zero_grad()
        if measure:
            self.comm_bytes = meter.volume_bytes
        return loss.item()


class DTensorTP(System):
    def __init__(self, cfg: GPTConfig, batch: int, plan: str, mesh: Mesh) -> None:
        super().__init__(cfg, batch)
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.full = plan == "full"
        layout: dict[str, Any] = {}
        for i in range(cfg.n_layers):
            for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
                layout[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.out_proj", "mlp.fc_out"):
                layout[f"layers.{i}.{name}"] = RowwiseParallel()
        if self.full:
            layout["embed.tok"] = RowwiseParallel(input_layouts=Replicate())
            layout["head.lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        self.model: nn.Module = parallelize_module(GPT(cfg, seed=0), mesh.device_mesh["tp"], layout)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)  # type: ignore[arg-type]

    def _loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        if not self.full:
            loss = F.cross_entropy(self.model(idx).flatten(0, -2), targets.flatten())
            torch.autograd.backward(loss)
            return loss
        with loss_parallel():
            loss = F.cross_entropy(self.model(idx).flatten(0, -2), targets.flatten())
            torch.autograd.backward(loss)
        return loss

    def step(self, i: int, measure: bool = False) -> float:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.debug import CommDebugMode

        idx, targets = self.data(i)
        if measure:
            counter, debug = _FunctionalCollectiveBytes(), CommDebugMode()  # type: ignore[no-untyped-call]
            with debug, counter:
                loss = self._loss(idx, targets)
            self.comm_bytes = counter.volume
            self.comm_counts = {str(k): v for k, v in debug.get_comm_counts().items()}
        else:
            loss = self._loss(idx, targets)
        self.opt.step()
        self.opt.zero_grad()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return float(value.item())


class Single(System):
    """Plain PyTorch in one process: the serial GPT on the whole batch, AdamW."""

    def __init__(self, cfg: GPTConfig, batch: int) -> None:
        super().__init__(cfg, batch)
        self.model: torch.nn.Module = GPT(cfg, seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)  # type: ignore[arg-type]

    def step(self, i: int, measure: bool = False) -> float:
        idx, targets = self.data(i)
        loss = F.cross_entropy(self.model(idx).flatten(0, -2), targets.flatten())
        torch.autograd.backward(loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class DDP(Single):
    """Data parallelism on the same ranks, for the issue's TP-against-DP ratio: torch DDP over
    the serial GPT, each rank its own batch of the same size (twice the tokens per step)."""

    def __init__(self, cfg: GPTConfig, batch: int) -> None:
        super().__init__(cfg, batch)
        self.model = torch.nn.parallel.DistributedDataParallel(self.model)  # same parameters

    def data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(self.cfg, self.batch, seed=1000 + i + 100_000 * dist.get_rank())


SINGLE = ("single", "torch-single")
DP = ("dp", "torch-ddp")


def _build(plan: str, system: str, cfg: GPTConfig, batch: int, mesh: Mesh) -> System:
    if system == "tessera":
        return Tessera(cfg, batch, plan, mesh)
    if system == "torch-ddp":
        return DDP(cfg, batch)
    return DTensorTP(cfg, batch, plan, mesh)


def _single_step(system: System, i: int) -> float | None:
    """Rank 0 steps the one-process system; every rank meets at a barrier after (untimed)."""
    loss = system.step(i) if dist.get_rank() == 0 else None
    dist.barrier()
    return loss


def _run(
    rank: int, cfg: GPTConfig, batch: int, warmup: int, iters: int, folder: str | None, prof_steps: int
) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    # DTensor's loss_parallel fires module backward hooks on an input without grad; harmless here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    mesh = Mesh(Topology(tp=dist.get_world_size()))
    runs = (*RUNS, SP_RUN, NO_OVERLAP_RUN, CHUNKS_RUN, DP)
    tiny = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    for plan, name in runs:  # first use of each code path (lazy initialisation) outside the timings
        _build(plan, name, tiny, 1, mesh).step(0)
    systems = {run: _build(*run, cfg, batch, mesh) for run in runs}
    single = Single(cfg, batch)
    for i in range(warmup):
        for system in systems.values():
            system.step(i, measure=i == warmup - 1)
        _single_step(single, i)
    times: dict[tuple[str, str], list[float]] = {run: [] for run in (*runs, SINGLE)}
    out: dict[str, dict[str, Any]] = {}
    for i in range(warmup, warmup + iters):
        for run, system in systems.items():
            t0 = time.perf_counter()
            loss = system.step(i)
            times[run].append(time.perf_counter() - t0)
            out.setdefault("/".join(run), {})["final_loss"] = loss
        t0 = time.perf_counter()
        single_loss = _single_step(single, i)  # rank 0's time counts; the barrier is outside
        times[SINGLE].append(time.perf_counter() - t0)
        out.setdefault("/".join(SINGLE), {})["final_loss"] = single_loss
    for run, system in (*systems.items(), (SINGLE, single)):
        rec = out["/".join(run)]
        rec["step_time_s"] = sorted(times[run])[len(times[run]) // 2]
        rec["comm_bytes"] = system.comm_bytes
        rec["comm_counts"] = system.comm_counts
    if folder is not None:
        step = warmup + iters
        for run, system in systems.items():
            trace = f"{folder}/{'-'.join(run).replace('+', '_')}-rank{rank}.json"
            b = profile_steps(functools.partial(system.step, step), prof_steps, trace)
            out["/".join(run)] |= {"breakdown": b.as_record(), "breakdown_trace": trace}
        if rank == 0:
            trace = f"{folder}/single-rank0.json"
            b = profile_steps(functools.partial(single.step, step), prof_steps, trace)
            out["/".join(SINGLE)] |= {"breakdown": b.as_record(), "breakdown_trace": trace}
        dist.barrier()
    mesh.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpt_args(parser, seq=64, batch=4, iters=10)
    add_breakdown_args(parser, "tp", "each system")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = gpt_config(args)
    world = 2
    folder = breakdown_folder(args, "tp")
    with WorkerPool(world, timeout=900) as pool:
        per_rank = pool.run(_run, cfg, args.batch, args.warmup, args.iters, folder, args.breakdown_steps)
    psi = sum(p.numel() for p in GPT(cfg, seed=0).parameters())
    records: list[dict[str, Any]] = []
    for plan, name in (*RUNS, SP_RUN, NO_OVERLAP_RUN, CHUNKS_RUN, DP, SINGLE):
        key = f"{plan}/{name}"
        ranks = per_rank[:1] if name == "torch-single" else per_rank
        step_time = max(r[key]["step_time_s"] for r in ranks)
        rec: dict[str, Any] = {
            "bench": "tp",
            "system": name,
            "config": (
                f"{'dp' if name == 'torch-ddp' else 'tp'}={1 if name == 'torch-single' else world} "
                f"plan={plan} gpt {psi / 1e6:.1f}M "
                f"d={cfg.d_model} heads={cfg.n_heads} "
                f"L={cfg.n_layers} V={cfg.vocab_size} seq={cfg.seq_len} batch={args.batch} AdamW fp32 gloo"
            ),
            "step_time_s": round(step_time, 4),
            "tokens_per_s": round(
                (world if name == "torch-ddp" else 1) * args.batch * cfg.seq_len / step_time, 1
            ),
            "comm_bytes": 2 * 4 * psi if name == "torch-ddp" else per_rank[0][key]["comm_bytes"],
            "comm_source": {"tessera": "CommMeter", "torch-single": None, "torch-ddp": "formula"}.get(
                name, "dispatch"
            ),
            "final_loss": round(per_rank[0][key]["final_loss"], 5),
            "ratio_vs_peer": None,
        }
        if per_rank[0][key]["comm_counts"] is not None:
            rec["comm_counts"] = per_rank[0][key]["comm_counts"]
        if "breakdown" in per_rank[0][key]:
            rec["breakdown"] = per_rank[0][key]["breakdown"]
            rec["breakdown_trace"] = per_rank[0][key]["breakdown_trace"]
        records.append(rec)
    single, ddp = records[-1], records[-2]
    for rec in records:
        rec["speedup_vs_single"] = round(rec["tokens_per_s"] / single["tokens_per_s"], 3)
        rec["vs_dp"] = round(rec["tokens_per_s"] / ddp["tokens_per_s"], 3)
    by_config = {(r["config"], r["system"]): r for r in records}
    for rec in records:
        peer = by_config.get((rec["config"], "torch-dtensor"))
        if rec["system"] == "tessera" and peer is not None:
            rec["ratio_vs_peer"] = round(peer["step_time_s"] / rec["step_time_s"], 3)
    for rec in records:
        emit(rec)
    if folder is not None:
        _write_breakdown(records, folder)
    table(
        records,
        (
            "system",
            "config",
            "step_time_s",
            "tokens_per_s",
            "comm_bytes",
            "final_loss",
            "ratio_vs_peer",
            "speedup_vs_single",
            "vs_dp",
        ),
    )


def _write_breakdown(records: list[dict[str, Any]], folder: str) -> None:
    from _breakdown import Breakdown

    bars = {}
    for rec in records:
        b = dict(rec["breakdown"])
        b.pop("fractions")
        plan = rec["config"].split("plan=")[1].split()[0]
        bars[f"{rec['system']}\n{plan}"] = Breakdown(**b)
    plot(bars, f"{folder}/breakdown.png", "tp=2, one step of rank 0 (torch.profiler)")
    with open(f"{folder}/results.jsonl", "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)


if __name__ == "__main__":
    main()
