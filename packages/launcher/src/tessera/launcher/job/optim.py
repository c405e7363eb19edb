"""The jobs' optimizer and learning-rate schedule, from ``[optim]`` and ``[train]``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from tessera.launcher.config import Config

__all__ = ["lr_factor", "optimizer_for"]


def optimizer_for(config: Config, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer (SGD, AdamW or Adam) over ``params`` with ``[optim]``'s settings."""
    o = config.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def lr_factor(config: Config) -> Callable[[int], float]:
    """The learning rate's factor at each step: linear warm-up over ``optim.warmup_steps``, then
    a cosine down to ``optim.min_lr_ratio`` at ``train.steps``."""
    warmup, total, floor = config.optim.warmup_steps, config.train.steps, config.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
