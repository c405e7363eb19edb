"""A batch as the engine takes it (one tensor, or the model's keyword inputs) cut into
microbatches: each tensor through ``tessera.pipeline.split_microbatches``, the one rule of
how a batch splits, so the engine's accumulation, the pipeline runtime and the verify step's
serial run see the same microbatches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

from torch import Tensor

from tessera.pipeline import split_microbatches

__all__ = ["Inputs", "split_inputs"]

Inputs: TypeAlias = Tensor | Mapping[str, Tensor]  # one tensor, or the model's keyword inputs


def split_inputs(inputs: Inputs, m: int) -> list[Inputs]:
    """``inputs`` as ``m`` equal microbatches of rows (a mapping: each of its tensors split,
    the same keys in each microbatch); ValueError naming the tensor that does not split."""
    if isinstance(inputs, Tensor):
        return list(split_microbatches(inputs, m, "inputs"))
    columns = zip(*(split_microbatches(v, m, f"inputs[{k!r}]") for k, v in inputs.items()), strict=True)
    return [dict(zip(inputs, parts, strict=True)) for parts in columns]
