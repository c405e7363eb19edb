"""A model larger than the processes' memory, from construction to export: a Llama-style model
of about 1.0B parameters (``_llama.py``, fp32: 4.1 GB of weights, 16.5 GB of weights, gradients
and AdamW moments) built on the meta device, loaded from a sharded checkpoint, trained 3 AdamW
steps and exported, on 2 processes of at most ``--cap-mib`` (3,072 MiB) peak resident memory
each, with the model states on disk; beside it the largest model FSDP2 with CPU offload and
DeepSpeed ZeRO-Infinity (NVMe offload) train under the same cap, and the disk's bandwidth.

What one run does, in order:

1. ``disk``: the sequential bandwidth of ``--disk-dir``'s file system: ``--probe-mib`` written
   in 8 MiB blocks and fsynced (write), dropped from the page cache (``POSIX_FADV_DONTNEED``)
   and read back (read). ``disk_limit_gbps`` is their harmonic mean, the rate of a traffic
   that reads and writes equal bytes; both are in the line.
2. The checkpoint: the model's parameters in Hugging Face's sharded safetensors layout
   (``model-0000K-of-0000N.safetensors`` of at most 256 MiB and
   ``model.safetensors.index.json``), written by this process one tensor at a time
   (``_llama.checkpoint_value``: never the whole model in memory).
3. ``tessera``: ``--world`` fresh processes (gloo, a FileStore), each: ``LlamaLM`` built under
   ``deferred_parameters()`` (parameters on the meta device); ``boost`` with dp = world,
   ZeRO-3, fp32, no gradient clipping (as the peers), the chunk manager with
   ``host_budget_mb = --host-budget-mib`` and
   ``disk_dir`` (each parameter made by its module's ``reset_parameters`` one flat buffer at a
   time, straight into its chunks); ``Engine.import_weights`` of the checkpoint (each rank
   reads the byte ranges of its shards); ``--steps`` AdamW steps on a fixed batch of
   ``--batch`` sequences of ``--seq`` tokens per rank (the loss must fall); ``Engine.export``
   to a second sharded checkpoint, whose index and sizes are checked by the parent.
   ``tessera`` steps each disk chunk during backward as its gradient arrives
   (``zero.step_in_backward``, the default); ``tessera-at-step`` is the same run with every
   chunk stepped at ``step()``, its gradient written to disk and read back. With both, a
   ``step-in-backward`` line gives their step time ratio, the bytes each wrote per step, and
   whether their losses and exported files (sha256) are the same bit for bit.
4. The peers, each with a ladder of sizes (``--peer-sizes``, ``dim:layers``, ascending) that
   stops at the first size over the cap or failing; each size is ``--world`` fresh
   processes that build the same ``LlamaLM`` without storage and train ``--steps`` AdamW steps
   on the same batches (they neither load nor export: less work than Tessera's run, so the
   comparison is, if anything, in their favour; ``_big_model_peers.py`` says how each is set up).

Figures, one JSON line per system and size: ``params``, ``world``, ``peak_rss_mb`` (the largest
``VmHWM`` over the ranks and the whole run, construction to export; glibc's mmap threshold is
pinned at 128 KiB so freed tensors leave the resident set), ``rss_cap_mb``, ``fits_cap``,
``step_s`` (the median step after the first; the first includes the chunk manager's warm-up),
``loss_first``, ``loss_last``, and for disk tiers ``disk_read_gbps`` / ``disk_write_gbps`` (the
bytes the step moved to and from disk over all ranks, per second of step) and
``disk_busy`` (the fraction of the step the disk would be busy with those bytes at its measured
rates: above 1 where the page cache absorbs part of them), and from the bytes that reached
the block layer (``/proc/self/io``) ``block_read_gbps``, ``block_write_gbps`` and
``disk_busy_block`` (DeepSpeed's aio uses O_DIRECT: its bytes are block-layer bytes).
Tessera's line also has each phase's seconds and resident peak. The last line gives
the goals: ``params >= 1.0e9`` under the cap, ``>= 3x`` the largest model either peer fits,
``disk_busy >= 0.5``.

Peers: FSDP2 runs in this Python; DeepSpeed in its own virtual environment, made on first use
(``peers.py``; ``hatch run bench peers`` makes it ahead of time; it needs ``libaio-dev`` from
apt for NVMe offload) or ``--deepspeed-python``. A peer that cannot run gives a line with
``error``, never a failed bench.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _big_model_peers import NEEDS, PEERS, peer_command, peer_ready
from _common import emit, status_kb, table
from _common import run_ranks as common_run_ranks
from _llama import LlamaLM, LlamaSize, checkpoint_value, fixed_batch
from _memory_peers import _io_bytes

OURS = ("tessera", "tessera-at-step")  # disk chunks stepped in backward / all at step()
SYSTEMS = (*OURS, *PEERS)
SHARD_BYTES = 256 * 2**20
GOAL_PARAMS, GOAL_RATIO, GOAL_BUSY = 1.0e9, 3.0, 0.5
logger = logging.getLogger("bench.big_model")


# ---------------------------------------------------------------------- the disk
def disk_bandwidth(directory: Path, mib: int) -> tuple[float, float]:
    """Sequential (write, read) GB/s of ``directory``'s file system: ``mib`` MiB written in
    8 MiB blocks and fsynced, dropped from the page cache, read back."""
    block = os.urandom(8 * 2**20)
    path = directory / "bandwidth.probe"
    n = max(1, mib // 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, len(block)):
            pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    nbytes = n * len(block)
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


# ---------------------------------------------------------------------- the checkpoint
def write_checkpoint(size: LlamaSize, directory: Path, seed: int) -> int:
    """The model's parameters as a sharded safetensors checkpoint with its index, one tensor
    in memory at a time; returns the bytes written."""
    import torch

    from tessera.comm.files import atomic_write
    from tessera.comm.safefile import Entry, StreamWriter, tensor_bytes
    from tessera.launcher.checkpoint.consolidate import split_shards

    entries = [Entry(name, torch.float32, shape) for name, shape in size.shapes()]
    shards = split_shards(entries, SHARD_BYTES)  # as an export cuts them
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with StreamWriter(directory / name, shard, {"format": "pt"}) as writer:
            for e in shard:
                writer.write(tensor_bytes(checkpoint_value(e.name, e.shape, seed)))
                weight_map[e.name] = name
            writer.commit()
    total = sum(e.nbytes for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(directory / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
    return total


def check_export(size: LlamaSize, directory: Path) -> str:
    """'' if ``directory`` holds an index naming every parameter once in shards with the right
    shapes, else what is wrong."""
    from tessera.comm.safefile import SafeFile

    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return f"no {index.name}"
    weight_map = json.loads(index.read_text())["weight_map"]
    want = dict(size.shapes())
    if set(weight_map) != set(want):
        return f"index names differ from the model's: {sorted(set(weight_map) ^ set(want))[:5]}"
    for file in sorted(set(weight_map.values())):
        for name, entry in SafeFile(directory / file).entries.items():
            if tuple(entry.shape) != want[name]:
                return f"{name} has shape {tuple(entry.shape)} in {file}, not {want[name]}"
    return ""


# ---------------------------------------------------------------------- Tessera's child
def tessera_child(args: argparse.Namespace) -> None:
    """One rank of Tessera's run; prints one JSON line of its figures."""
    import torch
    import torch.distributed as dist

    from tessera.launcher import Config, OptimConfig, ParallelConfig, TrainConfig, ZeroConfig, boost
    from tessera.launcher.train.deferred import deferred_parameters
    from tessera.zero import Precision

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    size = LlamaSize(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads
    )
    times: dict[str, float] = {}
    peaks: dict[str, float] = {}

    def phase(name: str, t0: float) -> None:
        times[f"{name}_s"] = round(time.perf_counter() - t0, 2)
        peaks[f"{name}_peak_rss_mb"] = round(status_kb("VmHWM") / 1024, 1)

    t0 = time.perf_counter()
    with deferred_parameters():
        model = LlamaLM(size)
    phase("build", t0)
    base = Config(
        parallel=ParallelConfig(dp=world, microbatches=1),
        zero=ZeroConfig(
            stage=3,
            disk_dir=args.chunk_dir,
            host_budget_mb=args.host_budget_mib,
            step_in_backward=not args.at_step,
        ),
        train=TrainConfig(precision=Precision.FP32, seed=0, verify=False),
        optim=OptimConfig(clip_grad_norm=0.0),  # as the peers: no clipping
    )
    config = _with_batch(base, args.batch * world)
    t0 = time.perf_counter()
    engine = boost(model, torch.optim.AdamW(model.parameters(), lr=args.lr), config)
    phase("boost", t0)
    t0 = time.perf_counter()
    engine.import_weights(args.checkpoint)
    phase("import", t0)
    x, y = fixed_batch(size, args.batch, args.seq, rank)
    losses, steps = [], []
    read0 = written0 = 0
    io0 = (0, 0)
    for step in range(args.steps):
        if step == 1:
            report = engine.zero.chunk_report() or {}
            read0, written0 = report.get("disk_read", 0), report.get("disk_written", 0)
            io0 = _io_bytes()
        t0 = time.perf_counter()
        losses.append(engine.train_step(x, y, local=True).loss)
        steps.append(time.perf_counter() - t0)
    report = engine.zero.chunk_report() or {}
    io1 = _io_bytes()
    peaks["train_peak_rss_mb"] = round(status_kb("VmHWM") / 1024, 1)
    t0 = time.perf_counter()
    engine.export(args.export)
    phase("export", t0)
    k = max(1, args.steps - 1)
    out = {
        "rank": rank,
        "params": size.params(),
        "steps": steps,
        "losses": losses,
        "disk_read_per_step": (report.get("disk_read", 0) - read0) / k,
        "disk_written_per_step": (report.get("disk_written", 0) - written0) / k,
        "block_read_per_step": (io1[0] - io0[0]) / k,
        "block_written_per_step": (io1[1] - io0[1]) / k,
        "disk_chunk_mb": round(report.get("disk", {}).get("bytes", 0) / 2**20, 1),
        "host_chunk_mb": round(report.get("host", {}).get("bytes", 0) / 2**20, 1),
        **times,
        **peaks,
        "peak_rss_mb": max(peaks.values()),
    }
    engine.close()
    print(json.dumps(out), flush=True)


def _with_batch(config: Any, batch: int) -> Any:
    import dataclasses

    return dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=batch))


# ---------------------------------------------------------------------- the parent
def run_ranks(cmd: list[str], env: dict[str, str], world: int, timeout: float) -> list[dict[str, Any]] | str:
    """``_common.run_ranks`` with glibc's mmap threshold pinned and one intra-op thread per rank."""
    pinned = {**env, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    return common_run_ranks(cmd, pinned, world, timeout)


def _rates(read: float, written: float, step_s: float, limits: tuple[float, float]) -> dict[str, Any]:
    """The step's disk traffic (bytes per step, summed over ranks) as GB/s and as the fraction
    of the step the disk would be busy at its measured (write, read) rates."""
    write_limit, read_limit = limits
    busy = (read / (read_limit * 1e9) + written / (write_limit * 1e9)) / step_s
    return {
        "disk_read_gbps": round(read / step_s / 1e9, 3),
        "disk_write_gbps": round(written / step_s / 1e9, 3),
        "disk_limit_gbps": round(2 / (1 / read_limit + 1 / write_limit), 3),
        "disk_busy": round(busy, 3),
    }


def _record(
    args: argparse.Namespace,
    system: str,
    size: LlamaSize,
    ranks: list[dict[str, Any]],
    limits: tuple[float, float],
) -> dict[str, Any]:
    step_s = statistics.median([t for r in ranks for t in r["steps"][1:]] or ranks[0]["steps"])
    peak = max(r["peak_rss_mb"] for r in ranks)
    rec: dict[str, Any] = {
        "bench": "big-model",
        "system": system,
        "config": f"{size.label()} seq={args.seq} b={args.batch}/rank adamw fp32",
        "params": ranks[0]["params"],
        "world": args.world,
        "peak_rss_mb": round(peak, 1),
        "rss_cap_mb": args.cap_mib,
        "fits_cap": peak <= args.cap_mib,
        "step_s": round(step_s, 2),
        "step_time_s": round(step_s, 2),
        "tokens_per_s": round(args.world * args.batch * args.seq / step_s, 1),
        "loss_first": round(ranks[0]["losses"][0], 4),
        "loss_last": round(ranks[0]["losses"][-1], 4),
    }
    read = sum(r.get("disk_read_per_step", 0) for r in ranks)
    written = sum(r.get("disk_written_per_step", 0) for r in ranks)
    if read or written:
        rec |= _rates(read, written, step_s, limits)
    if "block_read_per_step" in ranks[0]:  # what reached the device, below the page cache
        block = _rates(
            sum(r["block_read_per_step"] for r in ranks),
            sum(r["block_written_per_step"] for r in ranks),
            step_s,
            limits,
        )
        rec |= {"block_read_gbps": block["disk_read_gbps"], "block_write_gbps": block["disk_write_gbps"]}
        rec["disk_busy_block"] = block["disk_busy"]
    for key in ranks[0]:
        if (
            (key.endswith("_s") and key != "step_s")
            or key.endswith("_peak_rss_mb")
            or key.endswith("_chunk_mb")
        ):
            rec[key] = max(r[key] for r in ranks)
    return rec


def run_tessera(
    args: argparse.Namespace,
    system: str,
    size: LlamaSize,
    work: Path,
    checkpoint: Path,
    limits: tuple[float, float],
) -> dict[str, Any]:
    """One of Tessera's forms (``OURS``) from ``checkpoint`` to an export; its record, with the
    sha256 of every exported file (``export_sha256``) for comparing the forms bit for bit."""
    export, chunks = work / f"export-{system}", work / f"chunks-{system}"
    export.mkdir()
    cmd = [sys.executable, __file__, "--child", *_shape_args(args, size)]
    cmd += ["--checkpoint", str(checkpoint), "--export", str(export), "--chunk-dir", str(chunks)]
    cmd += ["--host-budget-mib", str(args.host_budget_mib)]
    cmd += ["--at-step"] if system == "tessera-at-step" else []
    ranks = run_ranks(cmd, {}, args.world, args.timeout)
    if isinstance(ranks, str):
        for d in (export, chunks):
            shutil.rmtree(d, ignore_errors=True)
        return _error(system, size, args, ranks)
    rec = _record(args, system, size, ranks, limits)
    rec["losses"] = ranks[0]["losses"]
    rec["disk_written_per_step"] = sum(r["disk_written_per_step"] for r in ranks)  # bytes, every rank
    rec["export_check"] = check_export(size, export) or "ok"
    rec["export_sha256"] = {f.name: _sha256(f) for f in sorted(export.iterdir())}
    for d in (export, chunks):
        shutil.rmtree(d, ignore_errors=True)
    return rec


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**24), b""):
            digest.update(block)
    return digest.hexdigest()


def compare_forms(ours: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Tessera stepping disk chunks in backward against stepping them at ``step()``: the step
    time ratio, bytes written per step, and whether losses and exports are bit for bit alike."""
    by = {r["system"]: r for r in ours if "error" not in r}
    if set(by) != set(OURS):
        return None
    early, late = by["tessera"], by["tessera-at-step"]
    return {
        "bench": "big-model",
        "system": "step-in-backward",
        "config": early["config"],
        "step_time_s": early["step_s"],
        "tokens_per_s": early["tokens_per_s"],
        "step_s_at_step": late["step_s"],
        "speedup": round(late["step_s"] / early["step_s"], 3),
        "disk_written_per_step": early["disk_written_per_step"],
        "disk_written_per_step_at_step": late["disk_written_per_step"],
        "same_losses": early["losses"] == late["losses"],
        "same_export": early["export_sha256"] == late["export_sha256"],
        "goal_half_step": late["step_s"] >= 2 * early["step_s"],
    }


def _shape_args(args: argparse.Namespace, size: LlamaSize) -> list[str]:
    shape = {"vocab": size.vocab, "dim": size.dim, "layers": size.layers, "heads": size.heads}
    shape |= {
        "kv-heads": size.kv_heads,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "lr": args.lr,
    }
    return [x for k, v in shape.items() for x in (f"--{k}", str(v))]


def _error(system: str, size: LlamaSize, args: argparse.Namespace, why: str) -> dict[str, Any]:
    return {
        "bench": "big-model",
        "system": system,
        "config": size.label(),
        "params": size.params(),
        "world": args.world,
        "step_time_s": 0.0,
        "tokens_per_s": 0.0,
        "error": why,
    }


def peer_ladder(
    args: argparse.Namespace, system: str, sizes: list[LlamaSize], work: Path, limits: tuple[float, float]
) -> tuple[list[dict[str, Any]], str]:
    """Ascending sizes until one passes the cap or fails; the records and how the ladder ended."""
    got = peer_command(system, args.deepspeed_python)
    if isinstance(got, str):
        emit(_error(system, sizes[0], args, got))
        return [], got
    cmd, env = got
    records: list[dict[str, Any]] = []
    for size in sizes:
        run_dir = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=work))
        full = [*cmd, "--system", system, *_shape_args(args, size), "--disk-dir", str(run_dir)]
        logger.warning("%s: %s (%.0fM parameters)", system, size.label(), size.params() / 1e6)
        ranks = run_ranks(full, env, args.world, args.timeout)
        shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(ranks, str):
            emit(_error(system, size, args, ranks))
            return records, f"{size.params() / 1e6:.0f}M: {ranks}"
        rec = _record(args, system, size, ranks, limits)
        emit(rec)
        records.append(rec)
        if not rec["fits_cap"]:
            return records, f"{size.params() / 1e6:.0f}M over the cap"
    return records, "every size fit"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--at-step", action="store_true", help=argparse.SUPPRESS)
    for name in ("store", "checkpoint", "export", "chunk-dir"):
        parser.add_argument(f"--{name}", default="", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cap-mib", type=float, default=3072.0, help="resident-memory cap per process")
    parser.add_argument("--host-budget-mib", type=float, default=256.0, help="Tessera's host tier per rank")
    parser.add_argument(
        "--peer-sizes",
        default="512:8,1024:8,1024:16,2048:4,2048:8,2048:12,2048:16,2048:20",
        help="the peers' ladder: dim:layers, ascending in parameters",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--disk-dir", default=None, help="where checkpoints and disk tiers go (default: a temp dir)"
    )
    parser.add_argument("--probe-mib", type=int, default=2048, help="bytes the disk bandwidth probe moves")
    parser.add_argument("--deepspeed-python", default=None, help="a Python with DeepSpeed (default: made)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per system and size")
    args = parser.parse_args()
    if args.child:
        tessera_child(args)
        return
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems has {unknown}; choose of {list(SYSTEMS)}")
    size = LlamaSize(args.vocab, args.dim, args.layers, args.heads, args.kv_heads)
    peer_sizes = [
        LlamaSize(args.vocab, int(d), int(n), args.heads, args.kv_heads)
        for d, n in (s.split(":") for s in args.peer_sizes.split(",") if s)
    ]
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-big-", dir=args.disk_dir))
    need = size.params() * (4 + 4 + 16) + 2**30  # two checkpoints, the disk tier, a margin
    free = shutil.disk_usage(work).free
    if any(s in OURS for s in systems) and free < need:
        shutil.rmtree(work, ignore_errors=True)
        parser.error(f"{work} has {free / 2**30:.1f} GiB free; the run needs about {need / 2**30:.1f} GiB")
    try:
        write_gbps, read_gbps = disk_bandwidth(work, args.probe_mib)
        limits = (write_gbps, read_gbps)
        emit({"bench": "big-model", "system": "disk", "config": f"sequential, {args.probe_mib} MiB, {work}",
              "step_time_s": 0.0, "tokens_per_s": 0.0, "disk_write_gbps": round(write_gbps, 3),
              "disk_read_gbps": round(read_gbps, 3),
              "disk_limit_gbps": round(2 / (1 / read_gbps + 1 / write_gbps), 3)})  # fmt: skip
        records: list[dict[str, Any]] = []
        largest: dict[str, int] = {}
        ours = [s for s in OURS if s in systems]
        if ours:
            checkpoint = work / "checkpoint"
            checkpoint.mkdir()
            t0 = time.perf_counter()
            nbytes = write_checkpoint(size, checkpoint, seed=0)
            write_s = time.perf_counter() - t0
            logger.warning("wrote the %.2f GB checkpoint in %.1f s", nbytes / 1e9, write_s)
            for system in ours:
                logger.warning("training with %s", system)
                rec = run_tessera(args, system, size, work, checkpoint, limits)
                rec |= {"checkpoint_write_s": round(write_s, 1), "checkpoint_gb": round(nbytes / 1e9, 2)}
                emit({k: v for k, v in rec.items() if k != "export_sha256"})
                records.append(rec)
            shutil.rmtree(checkpoint, ignore_errors=True)
            forms = compare_forms(records)
            if forms is not None:
                emit(forms)
        if any(s.startswith("deepspeed") for s in systems) and args.deepspeed_python is None:
            from peers import peer_python

            args.deepspeed_python = str(peer_python("deepspeed"))
        for system in [s for s in systems if s not in OURS]:
            why = peer_ready(system, args.deepspeed_python)
            recs, ended = ([], why) if why else peer_ladder(args, system, peer_sizes, work, limits)
            records += recs
            fits = [r["params"] for r in recs if r["fits_cap"]]
            largest[system] = max(fits, default=0)
            emit({"bench": "big-model", "system": system, "config": f"largest under {args.cap_mib:g} MiB",
                  "step_time_s": 0.0, "tokens_per_s": 0.0, "largest_params": largest[system],
                  "ladder_ended": ended, "needs": NEEDS[system]})  # fmt: skip
        emit(_goals(args, records, largest))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if records:
        keys = (
            "system",
            "params",
            "peak_rss_mb",
            "fits_cap",
            "step_s",
            "loss_first",
            "loss_last",
            "disk_busy",
        )
        table(records, keys)


def _goals(
    args: argparse.Namespace, records: list[dict[str, Any]], largest: dict[str, int]
) -> dict[str, Any]:
    ours = [r for r in records if r["system"] == "tessera" and r["fits_cap"]]
    params = max((r["params"] for r in ours), default=0)
    peer = max(largest.values(), default=0)
    busy = max((r.get("disk_busy", 0.0) for r in ours), default=0.0)
    return {
        "bench": "big-model",
        "system": "goals",
        "config": f"cap {args.cap_mib:g} MiB per process, world {args.world}",
        "step_time_s": 0.0,
        "tokens_per_s": 0.0,
        "tessera_params": params,
        "peer_largest_params": peer,
        "ratio_vs_peers": round(params / peer, 2) if peer else None,
        "disk_busy": busy,
        "goal_params_1e9": params >= GOAL_PARAMS,
        "goal_ratio_3x": bool(peer) and params >= GOAL_RATIO * peer,
        "goal_disk_busy_half": busy >= GOAL_BUSY,
    }


if __name__ == "__main__":
    main()
