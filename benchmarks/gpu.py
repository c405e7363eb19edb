"""``hatch run bench gpu``: the GPU script, ``benchmarks/gpu/run.py`` (its options: ``--help``)."""

from __future__ import annotations

import sys

from gpu import run

if __name__ == "__main__":
    raise SystemExit(run.main(sys.argv[1:]))
