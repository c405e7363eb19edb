"""Every script in examples/ runs as its docstring says, at a tiny size, in real processes.

Each is started the way a user starts it (``tessera run ...`` or ``python ...``) in a fresh
folder, and the test reads what it printed: the loss fell, the exported model's loss equals
the engine's, the chunks went to disk and were removed at the end, the PNGs were written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every example is a real launch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _tessera(nproc: int, *args: str) -> list[str]:
    return ["-m", "tessera.launcher.run.cli", "run", "--nproc-per-node", str(nproc), *args]


def _losses(out: str) -> tuple[float, float]:
    first, last = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups()  # type: ignore[union-attr]
    return float(first), float(last)


@pytest.mark.parametrize(
    "degrees",
    [["--set", "parallel.tp=2"], ["--set", "parallel.cp=2"], ["--set", "parallel.pp=2"]],
    ids=["tp2", "cp2", "pp2"],
)
def test_own_model(tmp_path: Path, degrees: list[str]) -> None:
    out = _run(_tessera(2, *degrees, str(EXAMPLES / "own_model.py"), "--steps", "12"), tmp_path)
    assert "verify: the first step equals the serial one" in out, out[-3000:]
    first, last = _losses(out)
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"


@pytest.mark.parametrize(
    "degrees",
    [["--set", "parallel.dp=2", "--set", "zero.stage=3"], ["--set", "parallel.pp=2"]],
    ids=["dp2-zero3", "pp2"],
)
def test_finetune_keeps_the_frozen_weights(tmp_path: Path, degrees: list[str]) -> None:
    """pp2 puts the frozen embedding and layers alone on rank 0: a rank with nothing to step."""
    out = _run(_tessera(2, *degrees, str(EXAMPLES / "finetune.py"), "--steps", "12"), tmp_path)
    assert "verify: the first step equals the serial one" in out, out[-3000:]
    first, last = _losses(out)
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"
    kept = re.search(r"frozen weights unchanged: (\d+) of (\d+) held", out)
    assert kept is not None and kept.group(1) == kept.group(2) != "0", out[-3000:]


def test_hf_llama_exports_what_it_trained(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = _run(_tessera(2, "--set", "parallel.tp=2", str(EXAMPLES / "hf_llama.py"), "--steps", "4"), tmp_path)
    found = re.search(r"held-out loss (\d+\.\d+) in Tessera, (\d+\.\d+) in transformers", out)
    assert found is not None, out[-3000:]
    assert found.group(1) == found.group(2)
    assert (tmp_path / "llama.safetensors").is_file()


def test_lora_saves_what_peft_and_transformers_load(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    out = _run(_tessera(2, "--set", "parallel.tp=2", str(EXAMPLES / "lora.py"), "--steps", "12"), tmp_path)
    fell = re.search(r"held-out loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert fell is not None and float(fell.group(2)) < float(fell.group(1)) - 0.3, out[-3000:]
    found = re.search(r"held-out loss (\d+\.\d+) in Tessera, (\d+\.\d+) in peft, (\d+\.\d+) merged", out)
    assert found is not None, out[-3000:]
    tessera, with_adapter, merged = (float(g) for g in found.groups())
    assert abs(with_adapter - tessera) <= 1e-4 and abs(merged - tessera) <= 1e-4, found.group(0)  # 4 decimals
    assert (tmp_path / "lora-example" / "adapter" / "adapter_config.json").is_file()
    # the docstring's second command: the same folder and file through tessera finetune
    sources = ["finetune.model=lora-example/pretrained", "finetune.data=lora-example/chat.jsonl"]
    args = ["--nproc-per-node", "2", "--set", "parallel.tp=2", "--set", "train.steps=40"]
    out = _run(
        ["-m", "tessera.launcher.run.cli", "finetune", *args, *(a for s in sources for a in ("--set", s))],
        tmp_path,
    )
    runs = list((tmp_path / "runs").glob("finetune-*"))
    assert len(runs) == 1 and (runs[0] / "adapter" / "adapter_model.safetensors").is_file(), out[-3000:]
    assert (runs[0] / "merged" / "config.json").is_file(), out[-3000:]


def test_disk_chunks(tmp_path: Path) -> None:
    config = str(EXAMPLES / "disk_chunks.toml")
    out = _run(_tessera(2, "--config", config, str(EXAMPLES / "disk_chunks.py"), "--steps", "3"), tmp_path)
    found = re.search(r"disk (\d+\.\d+) MiB; read (\d+\.\d+) MiB and wrote (\d+\.\d+) MiB", out)
    assert found is not None, out[-3000:]
    held, read, written = (float(g) for g in found.groups())
    assert held > 0 and read > 0 and written > 0, found.group(0)
    left = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file()]
    assert left == [], f"chunk files left after the engine closed: {left}"


def test_two_nodes_over_loopback(tmp_path: Path) -> None:
    """Both "nodes" of examples/two_nodes.sh on this machine, as its docstring says: two
    ``tessera run --nnodes 2 --node-rank K`` launches meeting at 127.0.0.1."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PORT": str(29000 + os.getpid() % 1000),
    }
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "two_nodes.sh"), "local"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"two_nodes.sh local exited {proc.returncode}:\n{out[-4000:]}"
    assert "verify: the first step equals the serial one" in out, out[-3000:]
    first, last = _losses(out)
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"


def test_pipeline_timeline(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "pipeline_timeline.py"), "--ranks", "2", "--microbatches", "4"], tmp_path)
    bubbles = dict(re.findall(r"^(\S+)\s+\d+\.\d+\s+(\d+\.\d+)%", out, flags=re.M))
    assert set(bubbles) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"}, out
    assert float(bubbles["zb-h1"]) < float(bubbles["1f1b"]), bubbles
    for name in bubbles:
        png = tmp_path / "timelines" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
