"""``Precision``: the compute precisions ZeRO trains in, importable without torch (a launcher
checks a configuration naming one before torch loads); ``tessera.zero.precision`` maps each
to its dtype."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Precision"]


class Precision(StrEnum):
    """The dtype parameters and activations are computed in; optimizer masters stay fp32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
