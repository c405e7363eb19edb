"""Run ``fn(rank, *args)`` on ``world`` fresh processes of one process group, on one device.

Each call forks its ranks from a forkserver that has already imported torch and Tessera (so a
rank starts in well under a second, and no rank inherits a CUDA context), joins them in a
process group over a FileStore in a private temp dir, and collects each rank's result or
error. A rank that raises, dies (a crash in a kernel included) or runs past ``timeout`` makes
the call raise `RankError`; the caller's process is never touched by the ranks' CUDA work.

Backends: ``"gloo"`` (CPU tensors), ``"nccl"`` (one rank per device: NCCL refuses two ranks
on one GPU, so a world of 1 here), ``"cpu:gloo,cuda:gloo"``: gloo for CUDA tensors too, which
lets several ranks share one GPU; `tessera.comm.default_device` then names the GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["PRELOAD", "RankError", "run_ranks"]

PRELOAD = ["torch", "torch.distributed", "tessera.launcher", "tessera.models", "gpu.modes"]


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and carries its error."""


def _rank_main(
    rank: int,
    world: int,
    backend: str,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import FileStore

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    try:
        if "cuda" in backend or backend == "nccl":
            torch.cuda.set_device(0)
        store = FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        result = fn(rank, *args)
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # reported to the caller, which decides
        payload = pickle.dumps(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    conn.send_bytes(payload)
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(world: int, backend: str, fn: Callable[..., Any], *args: Any, timeout: float) -> list[Any]:
    """``[fn(0, *args), ..., fn(world - 1, *args)]``, each on its own rank process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    tmp = tempfile.mkdtemp(prefix="tessera-gpu-")
    procs, conns = [], []
    try:
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world, backend, os.path.join(tmp, "store"), fn, args, child),
                daemon=True,
            )
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankError(f"ranks {sorted(pending)} of {world} ran past {timeout:.0f} s")
            for ready in wait(list(pending.values()), timeout=left):
                rank = next(r for r, c in pending.items() if c is ready)
                conn = pending[rank]
                del pending[rank]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    code = procs[rank].exitcode
                    raise RankError(f"rank {rank} of {world} died (exit code {code})") from None
                if status != "ok":
                    raise RankError(f"rank {rank} of {world}: {value}")
                results[rank] = value
        for proc in procs:
            proc.join(30)
        return [results[r] for r in range(world)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
