"""Test support for every Tessera package: threaded ranks, a gloo worker pool, bounds, import graphs.

- ``run_threaded(n, fn, *args)``: tier 1, ranks as threads (collectives only, milliseconds).
- ``WorkerPool(n).run(fn, *args)``: tier 2, ranks as persistent gloo processes (p2p too).
- The serial model the parallel ones are compared to, the reference GPT, lives in
  ``tessera.models`` (a package of its own, below every other one).
- ``assert_no_import_cycles("tessera.<pkg>")``: no import cycle between a package's modules
  (``tessera.comm.testing.imports``: the import graph from source, and its cycles).
- ``assert_adam_close(got, want, lr=, steps=)``: Adam-trained weights against serial, within
  a bound derived from the optimizer (``tessera.comm.testing.bounds``).
- ``tessera.comm.testing.fixtures``: pytest fixtures (import them into a conftest.py).
"""

from tessera.comm.testing.bounds import assert_adam_close
from tessera.comm.testing.imports import assert_no_import_cycles
from tessera.comm.testing.pool import PoolTimeout, RankFailure, WorkerPool
from tessera.comm.testing.threaded import run_threaded

__all__ = [
    "PoolTimeout",
    "RankFailure",
    "WorkerPool",
    "assert_adam_close",
    "assert_no_import_cycles",
    "run_threaded",
]
