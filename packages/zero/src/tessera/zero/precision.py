"""Mixed precision: the compute dtype of each precision, and a dynamic loss scaler for fp16.

Parameters are computed in the compute dtype (``fp32``, ``bf16`` or ``fp16``) while the
optimizer steps fp32 master shards. fp16 has a narrow range, so its losses are multiplied
by a scale before backward; the scaler halves the scale (and the step is skipped) when any
rank sees a non-finite gradient, and doubles it after ``growth_interval`` clean steps.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch
from torch import Tensor, nn

from tessera.zero.precisions import Precision

__all__ = ["DynamicLossScaler", "Precision", "cast_buffers_", "compute_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype parameters and activations are computed in for ``precision``."""
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {[str(p) for p in Precision]}, got {precision!r}")
    return _DTYPES[precision]


def cast_buffers_(module: nn.Module, dtype: torch.dtype, keep: Set[int] = frozenset()) -> None:
    """Cast the floating-point buffers of ``module`` to ``dtype`` in place (as ``module.to``),
    those in ``keep`` (by ``id``) to fp32."""
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            want = torch.float32 if id(buf) in keep else dtype
            if buf is not None and buf.is_floating_point() and buf.dtype != want:
                setattr(sub, name, buf.to(want))


class DynamicLossScaler:
    """A loss scale that backs off on overflow and grows after a run of clean steps.

    ``scale_loss`` multiplies a loss before backward (a pipeline seeds its backward with
    ``scale``), the optimizer divides the gradients by ``scale``, and ``update(overflow)`` is
    called once per step with the overflow flag every rank agreed on, so the scale stays
    identical across ranks. ``state_dict`` / ``load_state_dict`` are what every checkpoint
    format saves and restores.
    """

    def __init__(
        self,
        init_scale: float = 2.0**15,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        if init_scale <= 0 or min_scale <= 0:
            raise ValueError(f"scales must be > 0, got init_scale={init_scale}, min_scale={min_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` in fp32 times the scale: what backward starts from."""
        return loss.float() * self.scale

    def update(self, overflow: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps in a row."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: a dict of plain numbers."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.min_scale = float(state["min_scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale}, clean_steps={self.clean_steps})"
