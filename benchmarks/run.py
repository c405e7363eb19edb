"""``hatch run bench NAME``: run benchmarks/NAME.py (one JSON object per result line)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    names = sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and p.stem != "run")
    if not argv or argv[0] not in names:
        given = argv[0] if argv else "(none)"
        print(f"unknown benchmark {given!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    sys.argv = [str(HERE / f"{argv[0]}.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
