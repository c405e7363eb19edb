"""The single-process reference for the main job's throughput.

Before training, rank 0 trains a copy of the same serial model with plain PyTorch (the same
batch per step, AdamW, gradient clipping) for a few steps with torch using every core of the
machine, and times the steps after a warm-up. On a loaded machine (other jobs on the same
cores) one thread can beat several, so the reference is the faster of one thread and every
core. The other ranks wait at a barrier, so the
measurement has the machine to itself. The main job writes the figure into ``metrics.jsonl``
as a ``serial_tokens_per_s`` record and draws it as a reference line in ``plot.png``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

__all__ = ["SerialSpeed", "best_serial_tokens_per_s", "serial_tokens_per_s"]


@dataclass(frozen=True)
class SerialSpeed:
    """Tokens per second of plain single-process training, measured with ``threads`` threads."""

    tokens_per_s: float
    threads: int
    steps: int


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def serial_tokens_per_s(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Callable[[int], tuple[Tensor, Tensor]],
    *,
    device: torch.device,
    clip_grad_norm: float = 0.0,
    warmup: int = 2,
    steps: int = 6,
    threads: int | None = None,
) -> SerialSpeed:
    """Time ``steps`` training steps of ``model`` (after ``warmup`` untimed ones).

    ``model`` must have a ``loss(inputs, targets)`` method; ``batch(i)`` gives the inputs and
    targets of step ``i``. torch runs with ``threads`` threads (default: every core) and is
    set back to its previous thread count afterwards. The model and optimizer are trained in
    place: pass throwaway copies.
    """
    if warmup < 0 or steps < 1:
        raise ValueError(f"serial timing needs warmup >= 0, steps >= 1; got warmup={warmup}, steps={steps}")
    threads = threads or os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    loss_fn = cast(Callable[[Tensor, Tensor], Tensor], model.loss)  # a Module attribute: Tensor | Module
    tokens = 0
    try:
        model.train()
        start = 0.0
        for i in range(warmup + steps):
            if i == warmup:
                _sync(device)
                start = time.perf_counter()
            x, y = batch(i)
            x, y = x.to(device), y.to(device)
            torch.autograd.backward(loss_fn(x, y))
            if clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i >= warmup:
                tokens += x.numel()
        _sync(device)
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    return SerialSpeed(tokens / elapsed, threads, steps)


def best_serial_tokens_per_s(
    make: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
    batch: Callable[[int], tuple[Tensor, Tensor]],
    *,
    device: torch.device,
    clip_grad_norm: float = 0.0,
) -> SerialSpeed:
    """The faster of one thread and every core (``make()`` gives a fresh model and optimizer
    for each timing)."""
    counts = sorted({1, os.cpu_count() or 1}) if device.type == "cpu" else [torch.get_num_threads()]
    speeds = []
    for threads in counts:
        model, optimizer = make()
        speeds.append(
            serial_tokens_per_s(
                model, optimizer, batch, device=device, clip_grad_norm=clip_grad_norm, threads=threads
            )
        )
    return max(speeds, key=lambda s: s.tokens_per_s)
