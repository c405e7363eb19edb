"""``Precision``: the compute precisions ZeRO trains in, importable without torch (a launcher
checks a configuration naming one before torch loads) and the bytes of one element in each;
``tessera.zero.precision`` maps each to its dtype."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ELEMENT_BYTES", "Precision"]


class Precision(StrEnum):
    """The dtype parameters and activations are computed in; optimizer masters stay fp32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


ELEMENT_BYTES: dict[Precision, int] = {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2}
"""Bytes of one element computed in each precision (its dtype's ``itemsize``)."""
