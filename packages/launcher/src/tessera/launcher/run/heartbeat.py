"""A worker's side of the watchdog and of its tie to the launcher.

``Heartbeat`` (started by ``tessera.launcher.run.worker`` before the user's script) makes this
process die with the launcher (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, and a check of the
parent pid on every beat elsewhere), writes ``rank-<R>.json`` for ``watchdog.Watchdog``, counts
optimizer steps through torch's global optimizer step hook (no change to any training loop),
and lets the watchdog ask for the Python stack of every thread (``watchdog.STACK_SIGNAL`` ->
faulthandler).

It says which ``Phase`` the rank is in (``enter``, ``leave``). ``compiling`` is entered and left
through torch's own compile callbacks (``torch._dynamo.callback``): they span each compile of
dynamo (tracing, AOT autograd, inductor's codegen and its file locks) and AOT autograd's lazy
compile of a backward, on a compiled function's first calls and on every recompile, in any
thread, whoever called ``torch.compile``. They are registered once ``torch._dynamo`` is
imported (a script that never compiles never imports it), and again on the next beat after
``torch._dynamo.reset()``, which forgets them.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from tessera.launcher.run.watchdog import STACK_SIGNAL, Beat, Phase, beat_interval, write_beat

if TYPE_CHECKING:
    from torch._dynamo.callback import CallbackArgs, CompilationCallbackHandler

__all__ = ["Heartbeat", "after_import", "compiling", "die_with_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def compiling(limit_s: float) -> Phase:
    """The phase of a rank in torch.compile, under ``train.compile_watchdog_s`` (``limit_s``)."""
    return Phase("compiling", limit_s, "train.compile_watchdog_s")


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the heartbeat thread checks the parent pid instead
    if os.getppid() != parent:
        os._exit(1)


def after_import(name: str, then: Callable[[], None]) -> None:
    """Call ``then()`` once module ``name`` is imported: now if it is, else right after its first
    import completes, in the importing thread (an import hook that removes itself)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders, and has its loader call ``then()`` after it."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None:
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.then()

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's loader only
        return spec


class Heartbeat:
    """Beats for ``rank`` into ``directory`` from a daemon thread until ``done()``; while
    torch compiles, in the ``compiling`` phase under ``compile_watchdog_s``."""

    def __init__(
        self, directory: Path, rank: int, watchdog_s: float, parent: int | None, *, compile_watchdog_s: float
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.interval = beat_interval(watchdog_s)
        self.parent = parent
        self.compiling = compiling(compile_watchdog_s)
        self._steps: dict[int, int] = {}  # per optimizer (a wrapper and its inner one both step)
        self._step_time: float | None = None
        self._phase: Phase | None = None
        self._phase_time: float | None = None
        self._lock = threading.Lock()  # a beat's fields, and its file, in the order they change
        self._compiles: CompilationCallbackHandler | None = None
        self._stop = threading.Event()
        self._stack: TextIO | None = None

    def start(self) -> None:
        """Tie this process to its parent, count optimizer steps and compiles, start beating."""
        if self.parent is not None:
            die_with_parent(self.parent)
        register_optimizer_step_post_hook(self._stepped)
        after_import("torch._dynamo", self._watch_compiles)
        self._stack = (self.directory / f"rank-{self.rank}.stack").open("w")
        faulthandler.register(STACK_SIGNAL, file=self._stack, all_threads=True)
        self._beat()
        threading.Thread(target=self._loop, name="tessera-heartbeat", daemon=True).start()

    def enter(self, phase: Phase) -> None:
        """This rank begins ``phase``: progress, under the phase's own limit, until ``leave()``."""
        with self._lock:
            self._phase, self._phase_time = phase, time.time()
            self._write()

    def leave(self) -> None:
        """This rank's phase ends (that is progress too); nothing when it is in none."""
        with self._lock:
            if self._phase is not None:
                self._phase, self._phase_time = None, time.time()
                self._write()

    def done(self) -> None:
        """The script finished: stop beating and tell the watchdog this rank is not hung."""
        self._stop.set()
        self._beat(done=True)

    def _stepped(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        key = id(optimizer)
        self._steps[key] = self._steps.get(key, 0) + 1
        self._step_time = time.time()

    def _watch_compiles(self) -> None:
        """Enter ``compiling`` when torch starts a compile and leave it when it ends (torch counts
        nested and concurrent compiles as one); again if ``torch._dynamo.reset()`` forgot us."""
        try:
            if self._compiles is None:
                from torch._dynamo.callback import callback_handler

                self._compiles = callback_handler
            if self._compile_started not in self._compiles.start_callbacks:
                self._compiles.register_start_callback(self._compile_started)
                self._compiles.register_end_callback(self._compile_ended)
        except Exception as exc:  # never fail the import of torch._dynamo for this
            log.warning("the watchdog cannot see compiles (%s: %s)", type(exc).__name__, exc)

    def _compile_started(self, args: CallbackArgs) -> None:
        with contextlib.suppress(OSError):  # never fail a compile for this: the next beat says it
            self.enter(self.compiling)

    def _compile_ended(self, args: CallbackArgs) -> None:
        with contextlib.suppress(OSError):
            self.leave()

    def _beat(self, *, done: bool = False) -> None:
        with self._lock:
            self._write(done=done)

    def _write(self, *, done: bool = False) -> None:
        step = max(self._steps.values(), default=0)
        beat = Beat(
            self.rank, os.getpid(), time.time(), step, self._step_time, done, self._phase, self._phase_time
        )
        write_beat(self.directory, beat)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.parent is not None and os.getppid() != self.parent:
                os.kill(os.getpid(), signal.SIGKILL)  # the launcher is gone: so are we
            if self._compiles is not None:
                self._watch_compiles()
            self._beat()
