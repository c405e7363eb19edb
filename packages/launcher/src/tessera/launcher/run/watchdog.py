"""The launcher's hang detector: every rank heartbeats to a file, a thread here reads them.

Each worker (``heartbeat.Heartbeat``) rewrites ``rank-<R>.json`` in the job's heartbeat
folder every ``interval`` seconds: its pid, the time, how many optimizer steps it has taken
and when the last one was, and its ``Phase`` if it is in one (``compiling``: torch.compile's
dynamo tracing, AOT autograd and inductor codegen with their file locks, on a compiled
function's first calls and on every recompile). ``Watchdog`` (a thread in ``tessera run``)
ends the job when a rank, once it has taken an optimizer step, takes no further step or stops
beating (its process starved, or swapped out) for ``train.watchdog_s``, or its process is
stopped (SIGSTOP; state T in /proc) that long at any time. Before its first step a rank's slow
start is left to torch's own rendezvous and collective timeouts. The optimizer steps are
counted through torch's global optimizer hook, so no training loop reports anything; a script
that spends longer than the timeout between steps (a long evaluation or save) needs a larger
``train.watchdog_s`` or 0 (off).

A phase is progress under its own limit: a rank in one is judged by how long it has been in it
(``compiling``: ``train.compile_watchdog_s``; 0: no limit), before or after its first step. A
phase on this node is progress for every rank of it (the others wait for it in a collective)
until it outlasts its limit, and its end restarts the clock of every rank that has stepped, as
a step does.

It names the culprit: a frozen rank first, else the rank furthest behind, else every rank (a
collective no one completes), and the phase it was in. A rank still running is asked for its
Python stack (`STACK_SIGNAL`, SIGUSR2 -> faulthandler, into ``rank-<R>.stack``), then every local
worker is killed; the CLI then exits 1 with these lines. Torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["STACK_SIGNAL", "Beat", "Phase", "Watchdog", "beat_interval", "read_beats", "write_beat"]

# how the watchdog asks a rank for its Python stack (faulthandler); not SIGUSR1, the scheduler's
# warning before the time limit, which stops the main job (``stopping.STOP_SIGNALS``)
STACK_SIGNAL = signal.SIGUSR2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Phase:
    """Work a rank does between optimizer steps that is progress, under a limit of its own."""

    name: str  # what the rank is doing, as the watchdog says it: "compiling"
    limit_s: float  # how long the phase may last (0: no limit)
    setting: str  # the configuration field that sets ``limit_s``, named when the limit ends a job


@dataclass(frozen=True, slots=True)
class Beat:
    """What one rank last said: who it is, when, and its progress."""

    rank: int
    pid: int
    time: float
    step: int
    step_time: float | None
    done: bool = False
    phase: Phase | None = None  # the phase the rank is in, if any
    phase_time: float | None = None  # when it entered ``phase``; with none, when it left its last one

    def limit_s(self, timeout_s: float) -> float:
        """How long this rank may go without progress: its phase's limit, else ``timeout_s``."""
        limit = self.phase.limit_s if self.phase is not None else timeout_s
        return limit if limit > 0 else float("inf")


def beat_interval(watchdog_s: float) -> float:
    """How often ranks beat and the watchdog looks: a tenth of its timeout, 0.1 to 2 s (1 s when off)."""
    if watchdog_s <= 0:
        return 1.0
    return min(2.0, max(0.1, watchdog_s / 10))


def write_beat(directory: Path, beat: Beat) -> None:
    """Replace ``rank-<R>.json`` atomically with ``beat``."""
    path = directory / f"rank-{beat.rank}.json"
    tmp = path.with_suffix(f".{beat.pid}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(beat)))
    os.replace(tmp, path)


def read_beats(directory: Path) -> list[Beat]:
    """The latest beat of every rank that has written one."""
    beats = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            fields = json.loads(path.read_text())
            phase = fields.pop("phase", None)
            beats.append(Beat(**fields, phase=Phase(**phase) if phase is not None else None))
        except (OSError, ValueError, TypeError):
            continue
    return beats


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class Watchdog:
    """A daemon thread that ends the job when a local rank makes no progress for ``timeout_s``;
    ``report`` receives each line that says why (default: logged as errors)."""

    def __init__(
        self, directory: Path, timeout_s: float, report: Callable[[str], None] | None = None
    ) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.report = report if report is not None else log.error
        self.interval = beat_interval(timeout_s)
        self.fired: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tessera-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            lines = self.check(read_beats(self.directory), time.time())
            if lines:
                self.fired = lines
                for line in lines:
                    self.report(line)
                return

    def check(self, beats: list[Beat], now: float) -> list[str]:
        """Lines naming the hung rank(s) and their stacks, after killing every local worker;
        empty while every rank makes progress."""
        live = [b for b in beats if not b.done]
        # A phase on this node is progress for every rank of it (the others wait for it in a
        # collective), and its end restarts their clocks as a step does.
        ends = [now if b.phase is not None else b.phase_time for b in live]
        shared = max((t for t in ends if t is not None), default=None)
        silent = [b for b in live if self._silent(b, now)]
        stuck = [b for b in live if self._idle_s(b, shared, now) > b.limit_s(self.timeout_s)]
        if not silent and not stuck:
            return []
        frozen = [
            b
            for b in live
            if b in silent or (self._judged(b) and now - b.time > b.limit_s(self.timeout_s) / 2)
        ]
        behind = [b for b in stuck if b.step == min(s.step for s in stuck)]
        culprits = frozen or (behind if len(behind) < len(live) else stuck)
        lines = [self._headline(phase) for phase in dict.fromkeys(self._phase(b) for b in culprits)]
        if not frozen and culprits == stuck and len(stuck) > 1:
            lines.append("watchdog: every rank is waiting (a collective that no rank completes?)")
        for b in culprits:
            lines += self._describe(b, now)
        for b in live:
            _kill(b.pid)
        return lines

    @staticmethod
    def _judged(b: Beat) -> bool:
        """Whether ``b``'s progress is watched: once it has stepped, or while it is in a phase.
        Before the first step a slow start (imports, rendezvous, C++ calls that hold the GIL)
        is not taken for a hang."""
        return b.step_time is not None or b.phase is not None

    def _idle_s(self, b: Beat, shared: float | None, now: float) -> float:
        """How long ``b`` has made no progress (in a phase: how long it has been in it; 0 while
        it is not judged); ``shared``: when this node's ranks last made progress together."""
        if b.phase is not None:
            return now - (b.phase_time if b.phase_time is not None else b.time)
        if b.step_time is None:
            return 0.0
        return now - max(b.step_time, shared if shared is not None else b.step_time)

    def _silent(self, b: Beat, now: float) -> bool:
        """Whether ``b``'s heartbeat thread cannot run: its process stopped for the timeout, or
        (once judged) starved for its whole limit."""
        quiet = now - b.time
        if quiet > self.timeout_s and _state(b.pid) == "T":
            return True
        return self._judged(b) and quiet > b.limit_s(self.timeout_s)

    @staticmethod
    def _phase(b: Beat) -> Phase | None:
        """The phase whose limit judged ``b`` (none for a stopped process: the timeout did)."""
        return b.phase if b.phase is not None and _state(b.pid) != "T" else None

    def _headline(self, phase: Phase | None) -> str:
        if phase is None:
            return f"watchdog: no progress for {self.timeout_s:g} s (train.watchdog_s); ending the job"
        limit = f"{phase.limit_s:g} s while {phase.name} ({phase.setting})"
        return f"watchdog: no progress for {limit}; ending the job"

    def _describe(self, b: Beat, now: float) -> list[str]:
        last = (
            "no optimizer step yet"
            if b.step_time is None
            else f"last step {b.step}, {now - b.step_time:.1f} s ago"
        )
        if b.phase is not None:
            last = f"{b.phase.name} for {self._idle_s(b, None, now):.1f} s, {last}"
        state = _state(b.pid)
        head = f"watchdog: rank {b.rank} (pid {b.pid}) hung: {last}; last heartbeat {now - b.time:.1f} s ago"
        if state == "T":
            return [f"{head}; the process is stopped (SIGSTOP?), so no Python stack can be had"]
        stack = self.directory / f"rank-{b.rank}.stack"
        try:
            os.kill(b.pid, STACK_SIGNAL)
        except OSError:
            return [f"{head}; the process is gone"]
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not (stack.exists() and stack.stat().st_size):
            if _state(b.pid) in ("Z", "?"):
                return [f"{head}; the process is gone"]
            time.sleep(0.05)
        time.sleep(0.1)  # let faulthandler finish writing every thread
        text = stack.read_text(errors="replace").strip() if stack.exists() else ""
        threads = [t for t in text.split("\n\n") if "tessera/launcher/run/heartbeat.py" not in t]  # not ours
        lines = "\n\n".join(threads).splitlines()
        return [f"{head}; its Python stack:" if lines else f"{head}; no Python stack came back", *lines]


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
