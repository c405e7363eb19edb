"""Tier 3: a script of one's own under plain ``torchrun`` (how SLURM ``srun``, Kubernetes and cloud
job launchers start it), with no Tessera configuration at all: ``load_config()`` reads the world
from ``WORLD_SIZE`` and dp fills it, so the run is the one ``tessera run --set parallel.dp=2``
makes. ``examples/own_model.py`` prints its first and last loss and its layout; both launches
run the same code at the same degrees and seeds on the same machine with one thread per rank,
so the printed losses (4 decimals) are equal, not close.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real launches

OWN_MODEL = Path(__file__).resolve().parent.parent / "examples" / "own_model.py"
STEPS = ["--steps", "12"]


def _run(args: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}  # nothing configured
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _result(out: str) -> tuple[float, float, str]:
    found = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) in \d+ steps \((.*)\)$", out, flags=re.M)
    assert found is not None, out[-3000:]
    return float(found.group(1)), float(found.group(2)), found.group(3)


def test_plain_torchrun_infers_dp_and_trains_as_tessera_run(tmp_path: Path) -> None:
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    first, last, layout = _result(_run([*torchrun, str(OWN_MODEL), *STEPS], tmp_path))
    assert layout.startswith("pp=1 dp=2 cp=1 tp=1"), layout
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"
    tessera = ["-m", "tessera.launcher.run.cli", "run", "--nproc-per-node", "2", "--set", "parallel.dp=2"]
    assert _result(_run([*tessera, str(OWN_MODEL), *STEPS], tmp_path)) == (first, last, layout)
