"""Train a model whose optimizer state lives mostly on disk (the chunk memory manager).

    tessera run --nproc-per-node 2 --config examples/disk_chunks.toml examples/disk_chunks.py

``[zero]`` in the TOML file turns the manager on: each rank's fp32 masters, gradient shards
and Adam moments are cut into chunks placed on the device, host and disk under the budgets,
and the optimizer steps one chunk at a time, reading and writing the disk chunks as it goes.
The run is bit-for-bit the run without chunks; only where the state lives changes.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tessera.launcher import boost, load_config
from tessera.models import GPT, GPTConfig, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--d-model", type=int, default=64)
    args = parser.parse_args()

    config = load_config()
    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=args.d_model, n_heads=4, n_layers=4)
    model = GPT(cfg, seed=0)
    engine = boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    for step in range(args.steps):
        out = engine.train_step(*make_batch(cfg, 8, seed=step))
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {out.loss:.4f}")
    report = engine.zero.chunk_report()
    if dist.get_rank() == 0 and report is not None:
        mib = 2.0**20
        print(
            f"rank 0 holds {report['chunks']} chunks of {report['chunk_numel']} elements: "
            f"host {report['host']['bytes'] / mib:.2f} MiB, disk {report['disk']['bytes'] / mib:.2f} MiB; "
            f"read {report['disk_read'] / mib:.1f} MiB and wrote {report['disk_written'] / mib:.1f} MiB "
            f"of disk in {args.steps} steps"
        )
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
