"""Seeded initialisation that never touches the global RNG.

Every parameter tensor of a layer is drawn from its own generator, one *stream* of the
layer's seed: the router is stream 0, the shared expert stream 1 (further shared experts
``s >= 1`` stream ``-1 - s``), expert ``e`` stream ``2 + e``, the shared expert's gate stream
-1. So a rank that holds only some experts draws exactly the weights the serial layer has for
them, without drawing the others, and threads acting as ranks never race on torch's default generator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "ROUTER_STREAM",
    "SHARED_GATE_STREAM",
    "SHARED_STREAM",
    "expert_stream",
    "generator",
    "shared_stream",
    "uniform",
]

ROUTER_STREAM = 0
SHARED_STREAM = 1
SHARED_GATE_STREAM = -1
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct (seed, stream) pairs get distinct seeds


def expert_stream(expert: int) -> int:
    """The stream of the (global) expert index ``expert``."""
    return 2 + expert


def shared_stream(shared: int) -> int:
    """The stream of shared expert ``shared`` (0: `SHARED_STREAM`, as a layer with one has)."""
    return SHARED_STREAM if shared == 0 else -1 - shared


def generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for ``stream`` of ``seed``."""
    return torch.Generator().manual_seed((seed * _MIX + stream) % 2**63)


def uniform(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> Tensor:
    """A float32 tensor uniform in ``±1/sqrt(fan_in)`` (the bound of ``nn.Linear``'s init)."""
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)
