"""The peers' own Python environments, made by the benchmarks themselves.

A peer that cannot share Tessera's environment (DeepSpeed pins and builds its own things)
runs in a virtual environment of its own under ``benchmarks/out/peers/<name>`` (ignored by
git). ``peer_python("deepspeed")`` returns its interpreter, making it first when it is not
there: ``python -m venv``, then ``pip install torch==<this torch> deepspeed`` (the same torch
release as Tessera's, so both sides run the same kernels). ``hatch run bench peers`` makes
every peer environment ahead of a benchmark; ``--deepspeed-python`` on a benchmark points at
another interpreter instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE / "out" / "peers"
PACKAGES = {"deepspeed": ["deepspeed"]}

log = logging.getLogger("bench.peers")


def _torch_pin() -> str:
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def peer_python(name: str, *, make: bool = True) -> Path | str:
    """The interpreter of peer environment ``name`` (made when missing and ``make``), or why
    there is none ('not available: ...')."""
    python = ROOT / name / "bin" / "python"
    if python.exists():
        return python
    if not make:
        return f"not available: {python} does not exist (make it with `hatch run bench peers`)"
    log.warning("making the %s peer environment in %s (once; about a minute)", name, python.parents[1])
    try:
        venv.create(python.parents[1], with_pip=True, clear=True)
        cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", _torch_pin()]
        done = subprocess.run(
            [*cmd, *PACKAGES[name]], capture_output=True, text=True, timeout=1800, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not available: making {python.parents[1]} failed: {err}"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        return f"not available: pip install {' '.join(PACKAGES[name])} failed: {lines[-1]}"
    return python


def run_peer_ranks(
    python: str | Path, script: str, world: int, flags: list[str], *, timeout: float = 1800.0
) -> list[dict[str, Any]] | str:
    """Run ``benchmarks/<script>`` as ``world`` ranks in ``python`` (``--rank``, ``--world`` and
    ``--store``, a FileStore in a fresh temporary folder, added to ``flags``; gloo on the CPU,
    ``DS_ACCELERATOR=cpu``; Tessera's models and the benchmarks' helpers on ``PYTHONPATH``):
    each rank's last JSON line, or why there is none ('failed: <its last error line>')."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "packages" / "models" / "src"), str(HERE)]),
    }
    with tempfile.TemporaryDirectory(prefix="tessera-bench-peer-") as store:
        procs = [
            subprocess.Popen(
                [
                    str(python),
                    str(HERE / script),
                    f"--rank={r}",
                    f"--world={world}",
                    f"--store={store}/s",
                    *flags,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return f"failed: {script} ran past {timeout:g} s"
    results = []
    for p, (out, err) in zip(procs, outs, strict=True):
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            tail = (err.strip().splitlines() or ["(no output)"])[-1]
            return f"failed: {tail}"
        results.append(json.loads(lines[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="make the peers' Python environments")
    parser.add_argument("names", nargs="*", help=f"of {', '.join(sorted(PACKAGES))} (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    unknown = sorted(set(args.names) - set(PACKAGES))
    if unknown:
        parser.error(f"unknown peers {unknown}; choose of {sorted(PACKAGES)}")
    for name in args.names or sorted(PACKAGES):
        got = peer_python(name)
        print(f"{name}: {got}", file=sys.stdout if isinstance(got, Path) else sys.stderr)


if __name__ == "__main__":
    main()
