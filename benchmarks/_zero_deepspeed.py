"""The DeepSpeed ZeRO peer of ``benchmarks/zero.py --deepspeed``: one rank, run in DeepSpeed's
own Python (``peers.peer_python("deepspeed")``) beside the others of its world.

The same reference GPT (``tessera.models.GPT``, put on ``PYTHONPATH``), the same batches
(``make_batch`` with the bench's seeds: each rank its own ``--batch`` sequences),
``torch.optim.AdamW`` at the bench's learning rate, fp32, under ``deepspeed.initialize`` with
``zero_optimization.stage`` = ``--stage`` (1, 2 or 3) and its default buckets, over gloo
(``DS_ACCELERATOR=cpu``). After ``--warmup`` steps it times ``--iters`` (forward, backward,
step; a barrier before each, outside the timing) and prints one JSON line: its median step
time and losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from _memory_peers import deepspeed_gloo

from tessera.models import GPT, GPTConfig, make_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in (
        "rank",
        "world",
        "stage",
        "d_model",
        "heads",
        "layers",
        "vocab",
        "seq",
        "batch",
        "warmup",
        "iters",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--store", required=True)
    args = parser.parse_args()

    import deepspeed  # type: ignore[import-not-found, unused-ignore]

    torch.set_num_threads(1)
    deepspeed_gloo(args.store, args.rank, args.world)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
    )
    model = GPT(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 2**30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf)
    times, losses = [], []
    for step in range(args.warmup + args.iters):
        idx, targets = make_batch(cfg, args.batch, seed=1000 * step + args.rank)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        logits = engine(idx)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step >= args.warmup:
            times.append(elapsed)
    record = {"rank": args.rank, "step_s": statistics.median(times), "losses": losses}
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
