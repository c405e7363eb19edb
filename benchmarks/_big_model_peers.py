"""The peers of ``benchmarks/big-model.py``: one rank of FSDP2 with CPU offload or of DeepSpeed
ZeRO-Infinity, training ``_llama.LlamaLM`` built without storage; it prints the same JSON
line as Tessera's child (``steps``, ``losses``, ``peak_rss_mb``, ``params``, disk bytes).

- ``fsdp2-offload``: the model built under ``torch.device("meta")``; ``fully_shard`` on every
  block and the root with ``CPUOffloadPolicy(pin_memory=False)`` over a gloo mesh of all
  ranks; ``to_empty(device="cpu")`` then every module's ``reset_parameters`` (each rank makes
  only its shards); ``torch.optim.AdamW``. It runs in the bench's own Python.
- ``deepspeed-nvme``: ``deepspeed.zero.Init(remote_device="nvme")`` around the construction
  (each parameter partitioned and swapped out to NVMe as its module is built), then
  ``deepspeed.initialize`` with ZeRO stage 3 and parameters and optimizer state offloaded to
  NVMe (its ``async_io`` op: libaio, O_DIRECT) in a folder per rank, DeepSpeed's CPU AdamW,
  gloo (``DS_ACCELERATOR=cpu``). Its buffers are sized to this model as in
  ``_memory_peers._ds_config`` (that module's doc says why). It runs in a Python with
  DeepSpeed (``peers.peer_python``); this file imports only torch, deepspeed and the
  benchmarks' own ``_llama`` and ``_memory_peers``. Disk bytes: ``read_bytes`` /
  ``write_bytes`` of /proc/self/io over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from _common import status_kb
from _llama import LlamaLM, LlamaSize, fixed_batch
from _memory_peers import _ds_config, _io_bytes, deepspeed_gloo, deepspeed_version, fsdp2_offload

PEERS = ("fsdp2-offload", "deepspeed-nvme")
HERE = Path(__file__).resolve().parent
NEEDS = {
    "tessera": "torch and the Tessera packages (the hatch env); a directory",
    "fsdp2-offload": "torch only (fully_shard, CPUOffloadPolicy, meta-device init); gloo",
    "deepspeed-nvme": (
        "a venv with deepspeed and the same torch (made by `hatch run bench peers`); DS_ACCELERATOR=cpu; "
        "ninja and a C++ compiler for the JIT ops async_io and cpu_adam; libaio-dev (apt); a directory"
    ),
}


# ---------------------------------------------------------------------- parent side
def peer_command(system: str, ds_python: str | None) -> tuple[list[str], dict[str, str]] | str:
    """The interpreter, script and extra environment of ``system``'s ranks, or why it cannot run."""
    script = str(Path(__file__).resolve())
    if system == "fsdp2-offload":
        import sys

        return [sys.executable, script], {}
    if not ds_python or ds_python.startswith("not available"):
        return ds_python or "not available: no DeepSpeed python (pass --deepspeed-python)"
    return [ds_python, script], {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(HERE)}


def peer_ready(system: str, ds_python: str | None) -> str:
    """'' when ``system`` can run here, else why not."""
    if system.startswith("deepspeed"):
        version = deepspeed_version(ds_python or "not available: no DeepSpeed python")
        return version if version.startswith("not available") else ""
    return ""


# ---------------------------------------------------------------------- child side
def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    size = LlamaSize(args.vocab, args.dim, args.layers, args.heads, args.kv_heads)
    if args.system == "fsdp2-offload":
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
        with torch.device("meta"):
            model = LlamaLM(size)
        forward, backward, step_fn = fsdp2_offload(model, model.blocks(), world, args.lr)
        numel = sum(p.numel() for p in model.parameters())
    else:
        import deepspeed  # type: ignore[import-not-found, unused-ignore]

        deepspeed_gloo(args.store, rank, world)
        nvme = Path(args.disk_dir) / f"rank{rank}"
        nvme.mkdir(parents=True, exist_ok=True)
        conf = _ds_config("nvme", str(nvme), args.batch, max(size.vocab, size.ffn) * size.dim)
        conf["optimizer"]["params"]["lr"] = args.lr
        with deepspeed.zero.Init(config_dict_or_path=conf, remote_device="nvme", dtype=torch.float32):
            model = LlamaLM(size)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
        forward, backward, step_fn = engine, engine.backward, engine.step
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    x, y = fixed_batch(size, args.batch, args.seq, rank)
    steps, losses = [], []
    io0 = (0, 0)
    for step in range(args.steps):
        if step == 1:
            io0 = _io_bytes()
        t0 = time.perf_counter()
        logits = forward(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        backward(loss)
        step_fn()
        steps.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    io1 = _io_bytes()
    k = max(1, args.steps - 1)
    out: dict[str, Any] = {
        "rank": rank,
        "params": numel,
        "steps": steps,
        "losses": losses,
        "peak_rss_mb": status_kb("VmHWM") / 1024,
    }
    if args.system == "deepspeed-nvme":
        out |= {"disk_read_per_step": (io1[0] - io0[0]) / k, "disk_written_per_step": (io1[1] - io0[1]) / k}
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=PEERS, required=True)
    for key in ("vocab", "dim", "layers", "heads", "kv-heads", "seq", "batch", "steps"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--disk-dir", required=True)
    parser.add_argument("--store", required=True)
    child(parser.parse_args())


if __name__ == "__main__":
    main()
