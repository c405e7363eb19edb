"""Which optimizer state tensors are per element (and so belong in chunks)."""

from __future__ import annotations

import inspect
import logging

import torch
from torch import Tensor, nn

__all__ = ["probe_state_streams"]

log = logging.getLogger(__name__)


def probe_state_streams(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The names of the per-element state tensors ``optimizer``'s class keeps (Adam:
    ``exp_avg``, ``exp_avg_sq``), found by stepping a fresh one on a 4-element parameter."""
    dummy = nn.Parameter(torch.zeros(4))
    dummy.grad = torch.zeros(4)
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        probe = type(optimizer)([dummy], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        probe.step()
    except Exception as e:
        log.warning(
            "could not probe %s's state (%s); assuming two state tensors per element",
            type(optimizer).__name__,
            e,
        )
        return ("exp_avg", "exp_avg_sq")
    return tuple(
        k for k, v in probe.state[dummy].items() if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == 4
    )
