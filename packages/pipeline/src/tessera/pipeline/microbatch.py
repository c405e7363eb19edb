"""How a batch becomes microbatches: ``m`` equal slices along its first dimension, in order.

The pipeline runtime splits its batch with it, and so does anything that must see the same
microbatches (gradient accumulation without a pipeline, a serial run checked against a
parallel one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["split_microbatches"]


def split_microbatches(batch: Tensor, m: int, name: str = "batch") -> tuple[Tensor, ...]:
    """``batch`` as ``m`` equal microbatches along dim 0 (views, in order); ValueError naming
    ``name`` and its shape where its rows do not split into ``m`` equal parts."""
    if batch.dim() == 0 or batch.shape[0] % m:
        raise ValueError(f"{name} of shape {tuple(batch.shape)} do not split into {m} equal microbatches")
    return batch.chunk(m)
