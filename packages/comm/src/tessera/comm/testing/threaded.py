"""Run a function on N ranks as threads of this process over torch's threaded process group.

Tier 1 of the test harness: every rank is a thread, collectives are memory copies, so an
example costs milliseconds. The backend has collectives but no send/recv (use the worker
pool for p2p). The threaded backend lives in ``torch.testing._internal`` (a test-only
module of torch); it is installed for the duration of each call and removed after.
"""

from __future__ import annotations

import importlib
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

# torch-internal, untyped modules: reached through Any on purpose.
_mtpg: Any = importlib.import_module("torch.testing._internal.distributed.multi_threaded_pg")
_c10d: Any = importlib.import_module("torch._C._distributed_c10d")

__all__ = ["run_threaded"]

R = TypeVar("R")
_LOCK = threading.Lock()


def run_threaded(world_size: int, fn: Callable[..., R], *args: Any, timeout: float = 120.0) -> list[R]:
    """Call ``fn(rank, *args)`` on ``world_size`` threads, each initialised as that rank of a
    threaded default process group; return the results in rank order.

    An exception on any rank wakes the others and is re-raised here (lowest failing rank
    first) with a note naming the rank. A run still going after ``timeout`` seconds raises
    TimeoutError naming the ranks that did not finish.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    results: list[Any] = [None] * world_size
    errors: dict[int, tuple[BaseException, str]] = {}

    def body(rank: int, store: Any) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(rank, *args)
        except BaseException as exc:
            errors[rank] = (exc, traceback.format_exc())
            _mtpg.ProcessLocalGroup.exception_handle(exc)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    with _LOCK:
        _mtpg._install_threaded_pg()
        _c10d._set_thread_isolation_mode(True)  # per-thread group names
        try:
            store = _c10d.HashStore()
            threads = [
                threading.Thread(target=body, args=(r, store), name=f"rank{r}", daemon=True)
                for r in range(world_size)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
            if stuck:
                _mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
                for t in threads:
                    t.join(5.0)
                raise TimeoutError(f"ranks {stuck} of {world_size} still running after {timeout} s")
        finally:
            _mtpg.ProcessLocalGroup.reset()
            _c10d._set_thread_isolation_mode(False)
            _mtpg._uninstall_threaded_pg()
    real = {r: e for r, e in errors.items() if not isinstance(e[0], SystemExit)}
    if real:
        rank = min(real)
        exc, tb = real[rank]
        exc.add_note(f"raised on rank {rank} of {world_size} (threaded):\n{tb}")
        raise exc
    if errors:
        raise RuntimeError(f"ranks {sorted(errors)} of {world_size} exited early")
    return results
