"""The peers of ``benchmarks/memory.py``: FSDP2 with ``CPUOffloadPolicy`` and DeepSpeed ZeRO-3
with NVMe (ZeRO-Infinity) or CPU offload, each run as a fresh process that trains the same
reference GPT and prints the same JSON line as Tessera's child.

- ``torch-fsdp2-offload``: one gloo rank (FileStore), ``fully_shard`` on every block and the
  root with ``CPUOffloadPolicy(pin_memory=False)``, ``torch.optim.AdamW``; it runs in the
  bench's own Python.
- ``deepspeed-nvme`` / ``deepspeed-cpu``: ``deepspeed.initialize`` with ZeRO stage 3 and
  ``offload_param`` + ``offload_optimizer`` on ``nvme`` (a fresh folder under the bench's
  disk dir, through DeepSpeed's ``async_io`` op: libaio) or ``cpu``, DeepSpeed's AdamW (its
  CPU Adam), one gloo rank (``DS_ACCELERATOR=cpu``; without oneCCL DeepSpeed falls back to
  gloo). It runs in a separate Python that has DeepSpeed (``--deepspeed-python``); this
  script imports only torch, deepspeed, ``tessera.models`` (put on ``PYTHONPATH``) and
  ``_common``. The buffers DeepSpeed sizes for billions of parameters by default are sized
  to this model: ``sub_group_size``, the NVMe ``buffer_size`` and
  ``stage3_max_live_parameters`` are the largest parameter's element count rounded up to
  2**20; ``max_in_cpu=0`` (no parameter kept on the host beyond the swap buffers: with the
  default 1e9 every parameter stays in host memory and only the optimizer goes to NVMe);
  no prefetch and ``stage3_max_reuse_distance=0`` (with them, parameters held in the 5
  swap buffers run the buffers out: "Not enough buffers 0 for swapping 1").
- Every system builds the whole fp32 model before sharding it, as Tessera's children do.
  DeepSpeed partitions it through ``zero.Init(module=model, config_dict_or_path=...)``
  before ``initialize``, which would otherwise convert it with an explicit float32 dtype
  that DeepSpeed 0.19.8 maps to bfloat16 on the CPU accelerator (no fp16 there), and the
  NVMe-swapped weights then meet float activations: "expected m1 and m2 to have the same
  dtype, but got: float != c10::BFloat16".
- ``disk_*_per_step`` of DeepSpeed NVMe: bytes this process read and wrote at the block
  layer (``read_bytes``/``write_bytes`` of /proc/self/io; its aio uses O_DIRECT) over the
  steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import status_kb

PEERS = ("fsdp2-offload", "deepspeed-nvme", "deepspeed-cpu")
HERE = Path(__file__).resolve().parent
MODELS_SRC = HERE.parent / "packages" / "models" / "src"


# ---------------------------------------------------------------------- parent side
def peer_command(system: str, ds_python: str | None) -> tuple[list[str], dict[str, str]] | str:
    """The interpreter and extra environment that run ``system``'s child, or why it cannot run."""
    if system == "fsdp2-offload":
        return [sys.executable, str(Path(__file__).resolve())], {}
    if not ds_python:
        return "not available: no DeepSpeed python (pass --deepspeed-python, or `hatch run bench peers`)"
    if ds_python.startswith("not available"):
        return ds_python
    if not Path(ds_python).exists():
        return f"not available: {ds_python} does not exist"
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(MODELS_SRC), str(HERE)])}
    return [ds_python, str(Path(__file__).resolve())], env


def deepspeed_version(ds_python: str) -> str:
    """``import deepspeed`` in ``ds_python``: its version, or 'not available: <last error line>'
    (``ds_python`` may itself be such a line: ``peers.peer_python`` could not make one)."""
    import subprocess

    if ds_python.startswith("not available"):
        return ds_python

    code = "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    try:
        done = subprocess.run(
            [ds_python, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not available: {err}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return f"not available: import deepspeed failed: {lines[-1]}"
    ds, torch_version = done.stdout.split()[-2:]
    return f"deepspeed {ds}, torch {torch_version}"


# ---------------------------------------------------------------------- child side
def _io_bytes() -> tuple[int, int]:
    """``(read_bytes, write_bytes)`` of /proc/self/io: what reached the block layer."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _round_up(n: int, to: int = 2**20) -> int:
    return -(-n // to) * to


def _ds_config(device: str, nvme_dir: str, batch: int, largest: int) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer state offloaded to ``device`` (see the module doc)."""
    size = _round_up(largest)
    param: dict[str, Any] = {"device": device, "pin_memory": False}
    optim: dict[str, Any] = {"device": device, "pin_memory": False}
    if device == "nvme":
        param |= {"nvme_path": nvme_dir, "buffer_count": 5, "buffer_size": size, "max_in_cpu": 0}
        optim |= {"nvme_path": nvme_dir, "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": param,
            "offload_optimizer": optim,
            "sub_group_size": size,
            "stage3_max_live_parameters": size,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "steps_per_print": 2**30,
    }


def _init_gloo(store_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1)


Step = tuple[Callable[..., Any], Callable[..., Any], Callable[[], Any]]


def fsdp2_offload(model: Any, blocks: list[Any], world: int, lr: float) -> Step:
    """``fully_shard`` with ``CPUOffloadPolicy(pin_memory=False)`` on every block and the root
    over a gloo mesh of ``world`` ranks (the process group made already), ``torch.optim.AdamW``:
    the forward, the backward and the optimizer step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    if any(p.is_meta for p in model.parameters()):  # built without storage: each rank makes its shards
        model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def update() -> None:
        opt.step()
        opt.zero_grad()

    return model, torch.autograd.backward, update


def deepspeed_gloo(store: str, rank: int, world: int) -> None:
    """``deepspeed.init_distributed`` over gloo from a FileStore at ``store``, without the
    launcher's variables or MPI discovery (which wants mpi4py)."""
    import deepspeed  # type: ignore[import-not-found, unused-ignore]

    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
    deepspeed.init_distributed(
        dist_backend="gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        auto_mpi_discovery=False,
    )


def child(args: argparse.Namespace) -> None:
    """Build the GPT, wrap it in ``args.system``, train ``args.steps`` steps, print one JSON line."""
    import torch
    import torch.nn.functional as F

    from tessera.models import GPT, GPTConfig, make_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_heads=8, n_layers=args.layers
    )
    run_dir = tempfile.mkdtemp(prefix=f"{args.system}-", dir=args.disk_dir)
    if args.system == "fsdp2-offload":
        model = GPT(cfg, seed=0)
        _init_gloo(run_dir)
        forward, backward, step_fn = fsdp2_offload(model, list(model.blocks()), 1, 1e-4)
    else:
        import deepspeed  # type: ignore[import-not-found, unused-ignore]

        deepspeed_gloo(f"{run_dir}/store", 0, 1)
        largest = max(cfg.vocab_size, cfg.mlp_ratio * cfg.d_model, cfg.seq_len) * cfg.d_model
        conf = _ds_config(args.system.removeprefix("deepspeed-"), run_dir, args.batch, largest)
        model = GPT(cfg, seed=0)
        # Partition here, not in initialize(): see the module doc (float32 turned bfloat16).
        deepspeed.zero.Init(module=model, config_dict_or_path=conf)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
        forward, backward, step_fn = engine, engine.backward, engine.step
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    times, losses = [], []
    io0 = (0, 0)
    hwm = [status_kb("VmHWM")]  # as Tessera's child: built, through step 0, the rest
    for step in range(args.steps):
        if step == 1:
            hwm.append(status_kb("VmHWM"))
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (ru_maxrss too)
            io0 = _io_bytes()
        idx, tgt = make_batch(cfg, args.batch, seed=step)
        t0 = time.perf_counter()
        logits = forward(idx)
        loss = F.cross_entropy(logits.flatten(0, -2), tgt.flatten())
        backward(loss)
        step_fn()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    io1 = _io_bytes()

    out: dict[str, Any] = {
        "params": numel,
        "step_time_s": statistics.median(times[1:]),
        "step_times": times[1:],
        "train_peak_rss_mb": status_kb("VmHWM") / 1024,
        "final_loss": losses[-1],
        "peak_rss_mb": max(*hwm, status_kb("VmHWM")) / 1024,
    }
    if args.system == "deepspeed-nvme":
        k = args.steps - 1
        out |= {
            "disk_read_per_step": (io1[0] - io0[0]) / k,
            "disk_written_per_step": (io1[1] - io0[1]) / k,
            "disk_source": "/proc/self/io",
        }
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=PEERS, required=True)
    for key in ("width", "layers", "vocab", "seq", "batch", "steps"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--disk-dir", required=True)
    child(parser.parse_args())


if __name__ == "__main__":
    main()
