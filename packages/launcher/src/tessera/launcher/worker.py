"""What every rank of ``tessera run`` executes: rank-aware logging, then the user's script.

Wrapped in torch's ``record`` so that an exception on any rank is written to the elastic
agent's error file, and the agent prints that rank's traceback when it ends the job.
"""

from __future__ import annotations

import logging
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from tessera.comm import configure_logging
from tessera.launcher.config_io import load_config

__all__ = ["main"]


@record
def main() -> None:
    """Run ``sys.argv[1:]`` (``script.py args`` or ``-m module args``) as ``__main__``."""
    argv = sys.argv[1:]
    if not argv:
        raise SystemExit("tessera.launcher.worker: nothing to run")
    config = load_config()
    configure_logging(getattr(logging, config.logging.level.upper()), all_ranks=config.logging.all_ranks)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
