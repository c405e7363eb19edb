"""The GPU script: every check prints one JSON line; nothing raises out of it.

``python benchmarks/gpu/run.py [--device cuda|cpu] [--size tiny|full] [--out DIR] [--budget-s S]``
(or ``hatch run bench gpu -- ...``). Lines: ``{"check": ..., "device": ..., "ok": ...,
...figures}``; a check that fails is ``"ok": false`` with its ``error``; one that needs CUDA
on a CPU run, or that the time budget no longer covers, is ``"ok": null`` with ``skipped``
saying why. The last line is the ``summary``. Exit status 0 when no check failed, else 1.

Process layout on one device: a world of several ranks shares the GPU through gloo with CUDA
tensors (``cpu:gloo,cuda:gloo``: NCCL refuses two ranks on one device); the ``nccl-zero1``
mode and the MFU run are worlds of one under NCCL. On CUDA each check runs in fresh rank
processes (`gpu.ranks`), so a crash or a hang (``--check-timeout-s``) in one is that check's
failure and the script goes on; on the CPU the checks share a gloo worker pool per world size.
``--size`` defaults to ``full`` on CUDA and ``tiny`` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: ``gpu.*`` lives in benchmarks/
    sys.path.insert(0, str(HERE.parent))

os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])

import torch  # noqa: E402

from gpu import collectives, modes, perf  # noqa: E402
from gpu.ranks import RankError, run_ranks  # noqa: E402
from tessera.comm.testing import WorkerPool  # noqa: E402

Record = dict[str, Any]


class Run:
    """One invocation: its options, the deadline, and the serial reference (made once)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device: str = args.device
        self.size: str = args.size
        self.out = Path(args.out)
        self.deadline = time.monotonic() + args.budget_s
        self.check_timeout: float = args.check_timeout_s
        self.fresh: bool = args.fresh
        self.sizes = modes.sizes(self.size)
        self._serial: modes.Run | None = None
        self._pools: dict[int, WorkerPool] = {}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def backend(self, world: int) -> str:
        """gloo on the CPU; on CUDA NCCL for a world of one, gloo with CUDA tensors otherwise."""
        if not self.cuda:
            return "gloo"
        return "nccl" if world == 1 else "cpu:gloo,cuda:gloo"

    def left(self) -> float:
        return float(self.deadline - time.monotonic())

    def ranks(self, world: int, fn: Callable[..., Any], *args: Any, backend: str | None = None) -> list[Any]:
        """``fn`` on every rank of a world of ``world``: on the CPU on a persistent gloo
        worker pool per world size (started once, restarted after a failure: seconds saved
        per check on a small machine); on CUDA on fresh processes per check."""
        timeout = max(1.0, min(self.left(), self.check_timeout))
        if self.cuda or self.fresh:
            return run_ranks(world, backend or self.backend(world), fn, *args, timeout=timeout)
        if world not in self._pools:
            self._pools[world] = WorkerPool(world, timeout=timeout)
        return self._pools[world].run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    def serial(self) -> modes.Run:
        if self._serial is None:
            backend = "cpu:gloo,cuda:gloo" if self.cuda else "gloo"
            self._serial = self.ranks(1, modes.serial_run, self.sizes, self.device, backend=backend)[0]
        return self._serial


def mode_check(mode: str) -> Callable[[Run], list[Record]]:
    def check(run: Run) -> list[Record]:
        config = modes.config_of(mode, run.sizes)
        world = config.world_size
        serial = run.serial()
        results = run.ranks(world, modes.parallel_run, mode, run.sizes, run.device)
        return [{"world": world, "backend": run.backend(world), **modes.compare(results, serial, run.device)}]

    return check


def kernels_check(run: Run) -> list[Record]:
    return list(run.ranks(1, perf.kernel_check, run.size, run.device)[0])


def overlap_check(mode: str) -> Callable[[Run], list[Record]]:
    def check(run: Run) -> list[Record]:
        world = modes.config_of(mode, run.sizes).world_size
        run.out.mkdir(parents=True, exist_ok=True)
        got = run.ranks(world, perf.overlap_run, mode, run.sizes, run.device, str(run.out), 3)[0]
        return [
            {
                "world": world,
                "backend": run.backend(world),
                "ok": 0.0 <= got["overlap_fraction"] <= 1.0,
                **got,
            }
        ]

    return check


def collective_check(name: str) -> Callable[[Run], list[Record]]:
    def check(run: Run) -> list[Record]:
        got = run.ranks(2, collectives.probe, name, run.device)
        return [{"world": 2, "backend": run.backend(2), "ok": all(r["exact"] for r in got), **got[0]}]

    return check


def mfu_check(run: Run) -> list[Record]:
    got = run.ranks(1, perf.mfu_run, run.size, run.device, 3 if run.size == "tiny" else 10)[0]
    return [{"ok": bool(got["finite"]), **got}]


def checks() -> list[tuple[str, bool, Callable[[Run], list[Record]]]]:
    """(name, needs CUDA, check), in the order they run: the kernels and the MFU first, as
    the figures a GPU session is lent for, then the collectives, the modes that only a GPU
    runs, the other modes and the overlap traces; last what rests on point-to-point messages
    (the ring shift, ring attention, the pipeline), which gloo may not carry for CUDA
    tensors: a hang there (``--check-timeout-s``) then costs no other check its turn."""
    Check = tuple[str, bool, Callable[[Run], list[Record]]]
    first: list[Check] = [("cp-kernels", False, kernels_check), ("mfu", False, mfu_check)]
    last: list[Check] = []
    for name in collectives.PROBES:
        (last if name == "ring_shift" else first).append(
            (f"collective:{name}", False, collective_check(name))
        )
    for name in sorted(modes.MODES, key=lambda m: not modes.MODES[m][2]):  # the CUDA-only ones first
        (last if name in modes.P2P_MODES else first).append(
            (f"mode:{name}", modes.MODES[name][2], mode_check(name))
        )
    first += [(f"overlap:{name}", False, overlap_check(name)) for name in ("dp2-zero3", "tp2-sp")]
    return first + last


def emit(record: Record) -> None:
    print(json.dumps(record, default=str), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--size", choices=("tiny", "full"), default=None)
    parser.add_argument("--out", default="benchmarks/out/gpu", help="folder for the profiler traces")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    parser.add_argument(
        "--check-timeout-s", type=float, default=150.0, help="the most one world of ranks may take (a hang)"
    )
    parser.add_argument("--fresh", action="store_true", help="fresh rank processes per check on the CPU too")
    parser.add_argument("--only", default="", help="comma-separated check-name prefixes to run")
    args = parser.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "tiny")
    if args.device == "cuda" and not torch.cuda.is_available():
        emit(
            {
                "check": "setup",
                "device": "cuda",
                "ok": False,
                "error": "--device cuda: torch sees no CUDA device",
            }
        )
        return 2
    run = Run(args)
    wanted = [w for w in args.only.split(",") if w]
    started = time.monotonic()
    try:
        counts = _run_checks(run, wanted)
    finally:
        run.close()
    emit({"check": "summary", "device": run.device, "size": run.size, "ok": counts["failed"] == 0,
          **counts, "wall_s": round(time.monotonic() - started, 1)})  # fmt: skip
    return 0 if counts["failed"] == 0 else 1


def environment(run: Run) -> Record:
    """The first line: what the figures were measured with."""
    record: Record = {"check": "env", "device": run.device, "ok": True, "size": run.size}
    record |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    if run.cuda:
        props = torch.cuda.get_device_properties(0)
        record |= {"device_name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
        record |= {"capability": f"{props.major}.{props.minor}", "nccl": torch.cuda.nccl.version()}  # type: ignore[no-untyped-call]
    return record


def _run_checks(run: Run, wanted: list[str]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    emit(environment(run))
    for name, needs_cuda, check in checks():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        base: Record = {"check": name, "device": run.device}
        if needs_cuda and not run.cuda:
            records = [{**base, "ok": None, "skipped": "needs cuda"}]
        elif run.left() <= 0:
            records = [{**base, "ok": None, "skipped": "time budget"}]
        else:
            t0 = time.monotonic()
            try:
                records = [{**base, **r} for r in check(run)]
            except Exception as exc:  # a failing check is a line, and the script goes on
                error = f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, RankError):  # a rank's error carries its own traceback
                    error += "\n" + traceback.format_exc(limit=4)
                records = [{**base, "ok": False, "error": error[-3000:]}]
            for r in records:
                r["wall_s"] = round(time.monotonic() - t0, 2)
        for r in records:
            counts["skipped" if r["ok"] is None else "passed" if r["ok"] else "failed"] += 1
            emit(r)
    return counts


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
