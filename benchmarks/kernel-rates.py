"""One rank's kernels here, in fp32 and in bf16: what a single compute rate cannot describe.

On one thread, as a launcher's rank runs (``OMP_NUM_THREADS=1``):

- ``matmul``: FLOP/s of ``a @ b`` for each ``m x k x n`` of ``--shapes`` (the planner's
  calibration fits one rate per precision);
- ``attention``: seconds of ``F.scaled_dot_product_attention`` (causal) forward and backward
  on ``--rows`` x ``--seq`` tokens of ``--hidden`` features, at each head size of ``--heads``
  (the calibration's profile has 64 per head; the plan bench's model 32);
- ``gpt``: seconds of one forward and backward of the reference GPT (``--hidden``, 4 layers,
  ``--seq``, 4 rows, vocabulary 256) at the same head sizes, its parameters in fp32 and in
  bf16, and their ratio ``bf16_speedup``.

Each figure is the median of 10 timed calls after 3 untimed. ``hatch run bench kernel-rates``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import emit, median_time

from tessera.models import GPT, GPTConfig, make_batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _record(config: str, seconds: float, **extra: float) -> None:
    emit(
        {
            "bench": "kernel-rates",
            "system": "torch",
            "config": config,
            "step_time_s": round(seconds, 6),
            "tokens_per_s": 0.0,
            **extra,
        }
    )


def matmuls(shapes: list[tuple[int, int, int]]) -> None:
    gen = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        for name, dtype in DTYPES.items():
            a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
            reps = max(1, int(5e7 / (2 * m * k * n)))  # each timed call about as long whatever the shape

            def run(a: torch.Tensor = a, b: torch.Tensor = b, reps: int = reps) -> None:
                for _ in range(reps):
                    a @ b

            seconds = median_time(run) / reps
            _record(f"matmul {m}x{k}x{n} {name}", seconds, flops_per_s=round(2 * m * k * n / seconds, -6))


def attention(rows: int, seq: int, hidden: int, head_sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    for size in head_sizes:
        for name, dtype in DTYPES.items():
            q, k, v = (
                torch.randn(rows, hidden // size, seq, size, generator=gen).to(dtype).requires_grad_()
                for _ in range(3)
            )

            def run(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.backward(out, torch.ones_like(out))

            _record(f"attention {rows}x{seq} tokens d={hidden} {size} per head {name}", median_time(run))


def gpts(seq: int, hidden: int, head_sizes: list[int]) -> None:
    for size in head_sizes:
        cfg = GPTConfig(vocab_size=256, seq_len=seq, d_model=hidden, n_heads=hidden // size, n_layers=4)
        idx, targets = make_batch(cfg, 4, seed=0)
        seconds = {}
        for name, dtype in DTYPES.items():
            model = GPT(cfg, seed=0).to(dtype)

            def run(model: GPT = model, idx: torch.Tensor = idx, targets: torch.Tensor = targets) -> None:
                torch.autograd.backward(model.loss(idx, targets))

            seconds[name] = median_time(run)
        for name, s in seconds.items():
            extra = {"bf16_speedup": round(seconds["fp32"] / s, 3)} if name == "bf16" else {}
            _record(f"gpt d={hidden} {size} per head seq {seq} 4 rows {name}", s, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes",
        default="128x128x128,256x256x256,512x128x128,1024x256x256,4096x256x256",
        help="comma-separated m x k x n matmul shapes",
    )
    ap.add_argument("--heads", default="32,64", help="comma-separated sizes per head")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    shapes: list[tuple[int, int, int]] = []
    for text in args.shapes.split(","):
        dims = [int(v) for v in text.split("x") if v.isdigit()]
        if len(dims) != 3 or min(dims) < 1:
            raise SystemExit(f"--shapes: expected m x k x n of positive integers, got {text!r}")
        shapes.append((dims[0], dims[1], dims[2]))
    head_sizes = [int(h) for h in args.heads.split(",")]
    if any(h < 1 or args.hidden % h for h in head_sizes):
        raise SystemExit(f"--heads {args.heads!r}: each must divide --hidden {args.hidden}")
    torch.set_num_threads(1)
    matmuls(shapes)
    attention(args.rows, args.seq, args.hidden, head_sizes)
    gpts(args.seq, args.hidden, head_sizes)


if __name__ == "__main__":
    main()
