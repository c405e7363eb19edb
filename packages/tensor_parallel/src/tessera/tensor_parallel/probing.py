"""What the probes share: running a module in eval mode without gradients, and reading the
tensor it returns (``probe``, ``probe_modules``, ``context.probe``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["evaluating", "first_tensor"]


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode and no gradients; every module's training flag is restored after (modules
    added meanwhile keep the flag they were made with)."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module in model.modules():
            module.training = flags.get(module, module.training)


def first_tensor(out: Any) -> Tensor | None:
    """A module's tensor output, or the first element of a tuple or list when it is one."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], Tensor):
        return out[0]
    return None
