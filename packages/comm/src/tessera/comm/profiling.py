"""Profiler annotations of Tessera's communication, for step breakdowns from a trace.

While a ``torch.profiler`` session records, each collective of ``tessera.comm`` runs inside a
``record_function`` range named ``tessera.comm.<op>`` (the whole call: its copies, the ring
combines, the wait of a blocking call), each ``Handle.wait()`` inside
``tessera.comm.wait``, an async gloo ring on its lane thread inside ``tessera.comm.ring``,
and a wait for a peer's point-to-point message (a p2p ``Handle.wait()``, the pipeline
runtime's waits for its receives and sends) inside ``tessera.p2p.wait``. These ranges mark what the trace
cannot show otherwise: torch records no event while a thread blocks in a ``Work.wait()`` or
a ``Future.result()``. Without a profiler the check costs an attribute read and one C call
per collective.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch
from torch._C._autograd import _profiler_enabled

__all__ = ["COMM_PREFIX", "P2P_WAIT", "WAIT", "annotate", "profiled", "profiler_enabled"]

COMM_PREFIX = "tessera.comm."
"""Prefix of the ranges around Tessera's collectives (``tessera.comm.all_reduce``, ...)."""
WAIT = COMM_PREFIX + "wait"
"""The range around ``Handle.wait()`` of a collective."""
P2P_WAIT = "tessera.p2p.wait"
"""The range around a wait for a peer's point-to-point message (a p2p ``Handle.wait()``)."""

P = ParamSpec("P")
R = TypeVar("R")

_c_enabled: Callable[[], bool] = _profiler_enabled  # torch.autograd._profiler_enabled, from its typed home


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording: ``torch.profiler.profile``'s flag (which the C
    check misses when the profiler records every thread), else the C check."""
    return bool(torch.autograd.profiler._is_profiler_enabled) or _c_enabled()


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """A ``record_function(name)`` range while a profiler records; nothing otherwise."""
    if not profiler_enabled():
        yield
        return
    with torch.autograd.profiler.record_function(name):
        yield


def profiled(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so that it runs inside ``annotate(name)`` while a profiler records."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            if not profiler_enabled():
                return fn(*args, **kwargs)
            with torch.autograd.profiler.record_function(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
