"""Test support for every Tessera package: threaded ranks, a gloo worker pool, the reference GPT.

- ``run_threaded(n, fn, *args)``: tier 1, ranks as threads (collectives only, milliseconds).
- ``WorkerPool(n).run(fn, *args)``: tier 2, ranks as persistent gloo processes (p2p too).
- ``GPT``, ``GPTConfig``, ``make_batch``: the serial model the parallel ones are compared to.
- ``assert_no_import_cycles("tessera.<pkg>")``: no import cycle between a package's modules
  (``tessera.comm.testing.imports``: the import graph from source, and its cycles).
- ``assert_adam_close(got, want, lr=, steps=)``: Adam-trained weights against serial, within
  a bound derived from the optimizer (``tessera.comm.testing.bounds``).
- ``tessera.comm.testing.fixtures``: pytest fixtures (import them into a conftest.py).
"""

from tessera.comm.testing.bounds import assert_adam_close
from tessera.comm.testing.gpt import GPT, GPTConfig, make_batch
from tessera.comm.testing.imports import assert_no_import_cycles
from tessera.comm.testing.pool import PoolTimeout, RankFailure, WorkerPool
from tessera.comm.testing.threaded import run_threaded

__all__ = [
    "GPT",
    "GPTConfig",
    "PoolTimeout",
    "RankFailure",
    "WorkerPool",
    "assert_adam_close",
    "assert_no_import_cycles",
    "make_batch",
    "run_threaded",
]
