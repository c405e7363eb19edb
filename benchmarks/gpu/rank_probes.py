"""Three functions for `run_ranks`'s own test (``tests/test_gpu_script.py``): a rank process
imports them by this module's name, which every rank can import (``benchmarks/`` is on its
path), unlike a test module."""

from __future__ import annotations

import os

__all__ = ["dies_on_rank_one", "fails_on_rank_one", "rank_and_sum"]


def rank_and_sum(rank: int, scale: int) -> tuple[int, float]:
    """``(rank, sum over ranks of (rank + 1) * scale)``: one all-reduce."""
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(x)
    return rank, float(x)


def fails_on_rank_one(rank: int) -> int:
    """Raises on rank 1."""
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def dies_on_rank_one(rank: int) -> int:
    """Ends rank 1's process at once, as a crash in a kernel would."""
    if rank == 1:
        os._exit(3)
    return rank
