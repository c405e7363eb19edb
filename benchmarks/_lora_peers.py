"""The interpreters of ``bench lora``: one with Tessera, peft and transformers for the Tessera
ranks and the torch + peft process, and DeepSpeed's own for its ranks, with peft and
transformers added.

- ``lora_python``: ``--python`` if given, else this Python when it imports ``peft``,
  ``transformers`` and ``tessera.launcher``, else the ``hatch-test`` environment's (found by
  ``hatch env find hatch-test``: the workspace's environment that lists ``peft`` and
  ``transformers``; the default one, where ``hatch run bench`` runs, does not), else why none.
- ``deepspeed_python``: the DeepSpeed peer environment (``peers.peer_python("deepspeed")``,
  ``benchmarks/out/peers/deepspeed``, made on first use, or ``--deepspeed-python``), with
  ``peft`` and ``transformers`` at the versions ``lora_python`` has: installed into it with
  its own pip on first use when they are missing or differ (a minute; ``peers.py`` installs
  only DeepSpeed), so both sides run the same PEFT and modeling code; else why it cannot run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from _memory_peers import deepspeed_version
from peers import peer_python

NEEDS = "import peft, transformers, tessera.launcher"
VERSIONS = "import peft, transformers; print(peft.__version__, transformers.__version__)"


def _run(python: str, code: str, timeout: float = 300) -> tuple[bool, str]:
    """``python -c code``: whether it exited 0, and its stdout (else its last stderr line)."""
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, str(err)
    if done.returncode != 0:
        return False, (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return True, done.stdout.strip()


def _hatch_test_python() -> str | None:
    hatch = shutil.which("hatch")
    if hatch is None:
        return None
    try:
        done = subprocess.run(
            [hatch, "env", "find", "hatch-test"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        python = Path(line.strip()) / "bin" / "python"
        if python.exists():
            return str(python)
    return None


def lora_python(given: str | None) -> str:
    """The interpreter the Tessera and torch + peft processes run in (see the module doc);
    'not available: ...' when there is none."""
    candidates = [given] if given else [sys.executable, _hatch_test_python()]
    tried = []
    for python in candidates:
        if python is None:
            continue
        ok, out = _run(python, NEEDS)
        if ok:
            return python
        tried.append(f"{python}: {out}")
    return "not available: no Python with peft, transformers and Tessera (" + "; ".join(tried) + ")"


def versions(python: str) -> str:
    """``peft==X transformers==Y`` of ``python`` (an interpreter ``lora_python`` returned)."""
    ok, out = _run(python, VERSIONS)
    if not ok:
        raise RuntimeError(f"{python} does not import peft and transformers: {out}")
    peft, transformers = out.split()[-2:]
    return f"peft=={peft} transformers=={transformers}"


def deepspeed_python(given: str | None, pins: str) -> tuple[str, str]:
    """DeepSpeed's interpreter with ``pins`` (``versions()``) installed, and its versions; or
    ('', 'not available: ...')."""
    python = given or str(peer_python("deepspeed"))
    version = deepspeed_version(python)
    if version.startswith("not available"):
        return "", version
    ok, out = _run(python, VERSIONS)
    if not ok or f"peft=={out.split()[0]} transformers=={out.split()[-1]}" != pins:
        cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins.split()]
        print(f"bench lora: installing {pins} into {python}'s environment (once)", file=sys.stderr)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            return "", f"not available: pip install {pins} failed: {err}"
        if done.returncode != 0:
            last = ((done.stderr or done.stdout).strip().splitlines() or ["(no output)"])[-1]
            return "", f"not available: pip install {pins} failed: {last}"
    return python, f"{version}, {pins}"
