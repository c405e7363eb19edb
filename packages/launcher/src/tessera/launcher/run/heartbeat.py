"""A worker's side of the watchdog and of its tie to the launcher.

``Heartbeat`` (started by ``tessera.launcher.run.worker`` before the user's script) makes this
process die with the launcher (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, and a check of the
parent pid on every beat elsewhere), writes ``rank-<R>.json`` for ``watchdog.Watchdog``, counts
optimizer steps through torch's global optimizer step hook (no change to any training loop),
and lets the watchdog ask for the Python stack of every thread (SIGUSR1 -> faulthandler).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from tessera.launcher.run.watchdog import Beat, beat_interval, write_beat

__all__ = ["Heartbeat", "die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the heartbeat thread checks the parent pid instead
    if os.getppid() != parent:
        os._exit(1)


class Heartbeat:
    """Beats for ``rank`` into ``directory`` from a daemon thread until ``done()``."""

    def __init__(self, directory: Path, rank: int, watchdog_s: float, parent: int | None) -> None:
        self.directory = directory
        self.rank = rank
        self.interval = beat_interval(watchdog_s)
        self.parent = parent
        self._steps: dict[int, int] = {}  # per optimizer (a wrapper and its inner one both step)
        self._step_time: float | None = None
        self._stop = threading.Event()
        self._stack: TextIO | None = None

    def start(self) -> None:
        """Tie this process to its parent, count optimizer steps and start beating."""
        if self.parent is not None:
            die_with_parent(self.parent)
        register_optimizer_step_post_hook(self._stepped)
        self._stack = (self.directory / f"rank-{self.rank}.stack").open("w")
        faulthandler.register(signal.SIGUSR1, file=self._stack, all_threads=True)
        self._beat()
        threading.Thread(target=self._loop, name="tessera-heartbeat", daemon=True).start()

    def done(self) -> None:
        """The script finished: stop beating and tell the watchdog this rank is not hung."""
        self._stop.set()
        self._beat(done=True)

    def _stepped(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        key = id(optimizer)
        self._steps[key] = self._steps.get(key, 0) + 1
        self._step_time = time.time()

    def _beat(self, *, done: bool = False) -> None:
        step = max(self._steps.values(), default=0)
        write_beat(self.directory, Beat(self.rank, os.getpid(), time.time(), step, self._step_time, done))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.parent is not None and os.getppid() != self.parent:
                os.kill(os.getpid(), signal.SIGKILL)  # the launcher is gone: so are we
            self._beat()
