"""Dropout randomness for tensor parallelism: one explicit object per rank, no module globals.

Two streams per tensor-parallel rank (Megatron's RNG tracker, as an object passed to the
layers that need it):

- ``REPLICATED``: seeded ``seed`` on every rank of the group, so dropout on a tensor that
  every rank holds whole (the residual stream without sequence parallelism) draws the same
  mask everywhere and the replicas stay equal.
- ``SPLIT``: seeded ``seed + SPLIT_OFFSET + tp_rank``, so dropout on a tensor each rank holds
  a different part of (attention heads, a sequence shard) draws independent masks.

``ParallelDropout`` draws from a stream's generator directly (thread-safe). Code that only
draws from the global generator (dropout inside ``F.scaled_dot_product_attention``) runs
inside ``fork(region)``, which swaps the device's default generator state for the stream's
and back. That swap is process-wide: ranks run as threads of one process share it, so use
dropout inside attention only with one process per rank (threaded runs with dropout 0 are
unaffected, as nothing is drawn).

Seed per data-parallel replica as you wish: ranks of different tp groups given the same seed
draw the same masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Group, group_rank

__all__ = ["SPLIT_OFFSET", "DropoutRNG", "ParallelDropout", "RNGRegion"]

SPLIT_OFFSET = 2718  # Megatron's offset between the replicated and the per-rank seeds


class RNGRegion(StrEnum):
    """Whether the tensors a dropout sees are held whole by every tp rank or split across them."""

    REPLICATED = "replicated"
    SPLIT = "split"


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module: Any = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    gen: torch.Generator = module.default_generators[index]
    return gen


class DropoutRNG:
    """The replicated and split dropout streams of one tensor-parallel rank."""

    def __init__(self, seed: int, tp_rank: int, *, device: torch.device | str = "cpu") -> None:
        if tp_rank < 0:
            raise ValueError(f"tp_rank must be >= 0, got {tp_rank}")
        self.seed = seed
        self.tp_rank = tp_rank
        self.device = torch.device(device)
        self._generators = {
            RNGRegion.REPLICATED: torch.Generator(device=self.device).manual_seed(seed),
            RNGRegion.SPLIT: torch.Generator(device=self.device).manual_seed(seed + SPLIT_OFFSET + tp_rank),
        }
        self._saved: list[tuple[RNGRegion, torch.Generator, Tensor]] = []

    @classmethod
    def for_group(cls, seed: int, group: Group, *, device: torch.device | str = "cpu") -> DropoutRNG:
        """The streams of this rank of ``group`` (reads the rank; no communication)."""
        return cls(seed, group_rank(group), device=device)

    def generator(self, region: RNGRegion | str) -> torch.Generator:
        """The generator of one stream, for code that takes ``generator=``."""
        return self._generators[RNGRegion(region)]

    def generators(self) -> tuple[torch.Generator, ...]:
        """Both streams' generators (to save and replay their state, e.g. around a recomputed
        forward under activation checkpointing)."""
        return tuple(self._generators.values())

    def enter(self, region: RNGRegion | str) -> None:
        """Make ``region``'s stream the device's default generator until ``exit()``."""
        region = RNGRegion(region)
        default = _default_generator(self.device)
        saved = default.get_state()
        default.set_state(self._generators[region].get_state())
        self._saved.append((region, default, saved))

    def exit(self) -> None:
        """Store the advanced stream and give the default generator its state back."""
        region, default, saved = self._saved.pop()
        self._generators[region].set_state(default.get_state())
        default.set_state(saved)

    @contextmanager
    def fork(self, region: RNGRegion | str) -> Iterator[None]:
        """Run the block with ``region``'s stream as the global generator of the device."""
        self.enter(region)
        try:
            yield
        finally:
            self.exit()

    def __repr__(self) -> str:
        return f"DropoutRNG(seed={self.seed}, tp_rank={self.tp_rank}, device={self.device})"


class ParallelDropout(nn.Module):
    """Dropout whose mask comes from one stream of a DropoutRNG (moves nothing).

    Like ``nn.Dropout``: zeroes elements with probability ``p`` in training and scales the
    rest by 1/(1-p); the identity in eval mode or with p=0 (no number drawn).
    """

    def __init__(self, p: float, rng: DropoutRNG, region: RNGRegion | str) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p
        self.rng = rng
        self.region = RNGRegion(region)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        gen = self.rng.generator(self.region)
        keep = torch.rand(x.shape, generator=gen, device=gen.device) >= self.p
        return x * keep.to(x.device) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region.value}"
