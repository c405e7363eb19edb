"""What every rank of ``tessera run`` executes: ties to the launcher, then the user's script.

Before the script: the process dies with the launcher and heartbeats for its watchdog
(``heartbeat.Heartbeat``, torch's compiles in its ``compiling`` phase), and logging is
rank-aware. Wrapped in torch's ``record`` so that an exception on any rank is written to the
elastic agent's error file, and the agent prints that rank's traceback when it ends the job.

When the script returns (or exits 0), the worker runs the ``atexit`` handlers, flushes its
streams and leaves with ``os._exit(0)``: it skips the interpreter's teardown, where the
destructors of torch's process groups and their background threads can abort
(``terminate called without an active exception``) after a successful run. Whatever the
script wrote before returning is already on disk, so teardown cannot turn success into a
failure. (Threads the script left running are not joined.) A script ended by SIGINT (which
the launcher passes on after Ctrl-C and reports) leaves with 130 and no traceback; the main job
catches SIGINT, SIGTERM and SIGUSR1 itself, to save first (``stopping``).
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from tessera.comm import configure_logging
from tessera.launcher.config.config_io import HEARTBEAT_ENV, LAUNCHER_PID_ENV, load_config
from tessera.launcher.run.heartbeat import Heartbeat
from tessera.launcher.run.stopping import exit_code

__all__ = ["main"]


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _exit_now(code: int = 0) -> None:
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@record
def main() -> None:
    """Run ``sys.argv[1:]`` (``script.py args`` or ``-m module args``) as ``__main__``."""
    argv = sys.argv[1:]
    if not argv:
        raise SystemExit("tessera.launcher.run.worker: nothing to run")
    config = load_config()
    configure_logging(getattr(logging, config.logging.level.upper()), all_ranks=config.logging.all_ranks)
    heartbeat = None
    if os.environ.get(HEARTBEAT_ENV):
        parent = os.environ.get(LAUNCHER_PID_ENV)
        heartbeat = Heartbeat(
            Path(os.environ[HEARTBEAT_ENV]),
            int(os.environ.get("RANK", "0")),
            config.train.watchdog_s,
            int(parent) if parent else None,
            compile_watchdog_s=config.train.compile_watchdog_s,
        )
        heartbeat.start()
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except KeyboardInterrupt:  # SIGINT, passed on by the launcher, which says so: no traceback
        _exit_now(exit_code(signal.SIGINT))
    if heartbeat is not None:
        heartbeat.done()
    _exit_now()


if __name__ == "__main__":
    main()
