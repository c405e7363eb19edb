"""A persistent pool of N gloo worker processes that run example after example.

Tier 2 of the test harness. Starting torch in a process costs seconds, so the pool starts
its workers once (forked from a forkserver that has already imported torch), initialises a
gloo process group over a FileStore in a private temp dir (no port guessing), and then
runs ``fn(rank, *args)`` on every worker for each call. Workers are real processes, so p2p,
subgroups and DeviceMesh all work.

A call that fails on any rank raises that rank's exception here (with its traceback as a
note); a call that runs past its timeout raises PoolTimeout carrying the Python stack of
every rank that had not finished. Either way the pool is torn down and restarted on the
next call, so one bad example never poisons the next.

``fn`` must be a module-level function (it is found again in the worker by module and
file), and arguments and results must pickle. Messages cross only between this process
and the workers it spawned.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import inspect
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["PoolTimeout", "RankFailure", "WorkerPool"]

log = logging.getLogger(__name__)
R = TypeVar("R")
_GRACE_S = 1.0  # how long the other ranks get to finish after one fails


class PoolTimeout(RuntimeError):
    """A pool call ran past its timeout; the message carries the stuck ranks' stacks."""


class RankFailure(RuntimeError):
    """A rank failed with an exception that could not be sent back, or died."""


def _resolve(module: str, path: str | None, qualname: str) -> Callable[..., Any]:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if path is None:
                raise
            spec = importlib.util.spec_from_file_location(module, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {module} from {path}") from None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    resolved: Callable[..., Any] = obj
    return resolved


def _groups() -> list[Any]:
    """Every process group this process holds now (the default one included)."""
    import torch.distributed as dist

    return list(dist.distributed_c10d._world.pg_map)


def _release_groups_since(before: list[Any]) -> None:
    """Destroy the groups a task created. Gloo keeps threads (and some idle CPU) per group,
    so groups left behind by thousands of examples would load the whole machine."""
    import torch.distributed as dist

    keep = {id(pg) for pg in before}
    for pg in _groups():
        if id(pg) not in keep:
            with contextlib.suppress(Exception):  # a group a task already destroyed itself
                dist.destroy_process_group(pg)


def _worker_main(
    rank: int, world_size: int, store_path: str, trace_path: str, conn: Connection, pg_timeout_s: float
) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import FileStore  # dist.FileStore, typed

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # every rank on this host, as torchrun says
    trace_file = open(trace_path, "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=trace_file, all_threads=True)
    store = FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
    )
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        task = pickle.loads(message)
        if task is None:
            break
        module, path, qualname, args, env = task
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        groups = _groups()
        try:
            result = _resolve(module, path, qualname)(rank, *args)
            payload = pickle.dumps(("ok", result))
        except BaseException as exc:
            tb = traceback.format_exc()
            blob: bytes | None
            try:
                blob = pickle.dumps(exc)
                pickle.loads(blob)
            except Exception:
                blob = None
            payload = pickle.dumps(("err", (blob, f"{type(exc).__name__}: {exc}", tb)))
        finally:  # the process serves later calls: leave its environment and groups as they were
            _release_groups_since(groups)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        conn.send_bytes(payload)
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo ranks in worker processes, started on first use and reused.

    >>> with WorkerPool(2) as pool:
    ...     pool.run(some_module_level_fn, 3)   # [fn(0, 3), fn(1, 3)]
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0, pg_timeout: float = 300.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.starts = 0
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._dir: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
        self._dir = tempfile.mkdtemp(prefix="tessera-pool-")
        store = os.path.join(self._dir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            trace = os.path.join(self._dir, f"stack-{rank}.txt")
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store, trace, child, self.pg_timeout),
                name=f"tessera-worker-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.starts += 1
        t0 = time.monotonic()
        self._collect(self.timeout, what="start")
        log.info("worker pool of %d started in %.1f s", self.world_size, time.monotonic() - t0)

    def close(self) -> None:
        """Stop every worker (politely, then by force) and remove the temp dir."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ running
    def run(
        self,
        fn: Callable[..., R],
        *args: Any,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[R]:
        """Call ``fn(rank, *args)`` on every rank; return the results in rank order.

        ``env``: environment variables set in every worker for this call only.
        """
        if not self._procs:
            self._start()
        module = fn.__module__
        try:
            path: str | None = inspect.getfile(fn)
        except TypeError:
            path = None
        message = pickle.dumps((module, path, fn.__qualname__, args, dict(env or {})))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(self.timeout if timeout is None else timeout, what=fn.__qualname__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, tuple[bytes | None, str, str]] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if failures:
                remaining = min(remaining, _GRACE_S)
            if remaining <= 0:
                break
            ready = wait(list(pending.values()), timeout=remaining)
            if not ready:
                if failures:
                    break
                continue
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                del pending[rank]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    failures[rank] = (None, f"worker died (exit code {code})", "")
                    continue
                if status == "err":
                    failures[rank] = value
                else:
                    results[rank] = value
        if failures:
            self._kill()
            rank = min(failures)
            blob, text, tb = failures[rank]
            exc: BaseException = pickle.loads(blob) if blob is not None else RankFailure(text)
            exc.add_note(f"raised on rank {rank} of {self.world_size} ({what}):\n{tb}")
            raise exc
        if pending:
            stacks = self._stacks(sorted(pending))
            self._kill()
            raise PoolTimeout(
                f"{what}: ranks {sorted(pending)} of {self.world_size} did not finish within "
                f"{timeout:.1f} s; the pool was restarted. Their stacks:\n{stacks}"
            )
        return [results[r] for r in range(self.world_size)]

    def _stacks(self, ranks: list[int]) -> str:
        assert self._dir is not None
        for rank in ranks:
            pid = self._procs[rank].pid
            if pid is not None and self._procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        parts = []
        for rank in ranks:
            with open(os.path.join(self._dir, f"stack-{rank}.txt")) as f:
                parts.append(f"--- rank {rank} ---\n{f.read().strip()}")
        return "\n".join(parts)
