"""The RMS norms some HF expert banks and shared experts end in (Ergo's), read as
``tessera.moe``'s per-expert norms (`tessera.moe.Experts`' ``norm_eps``), each recognised by
the `source_key` of its ``forward`` as the kinds are (``hf_moe_kinds``).

- ``ergo.ErgoExpertNorm`` (a bank's ``post_expert_norm``): ``weight [E, d]``, each routed row's
  output normalised (fp32) and scaled by its expert's row, before the router weighs it;
- ``ergo.ErgoRMSNorm`` (a shared expert's ``norm``): ``weight [d]``, ``F.rms_norm`` in fp32.

Both hold their epsilon as ``eps``. ``tessera.moe`` normalises in fp32 and casts back before the
weight multiplies; the same in fp32, which is what these families train in here.
"""

from __future__ import annotations

from typing import Any

from tessera.launcher.families.hf_moe_kinds import source_key

__all__ = ["EXPERT_NORM", "SHARED_NORM", "read_norm"]

EXPERT_NORM = ("ergo.ErgoExpertNorm", "1bacad593bff1a0d")
SHARED_NORM = ("ergo.ErgoRMSNorm", "c114f3dda63f2389")


def read_norm(owner: Any, name: str, like: tuple[str, str], shape: tuple[int, ...]) -> tuple[str, float]:
    """``owner.<name>``, a norm computing what ``like`` (``(class, key)``) computes with a weight of
    ``shape``: its weight's name (relative to ``owner``) and its epsilon; ValueError naming what
    differs."""
    norm = getattr(owner, name)
    key = source_key(type(norm).forward)
    if key != like[1]:
        raise ValueError(
            f"its {name} ({type(norm).__name__}, source key {key}) does not compute what {like[0]} does"
        )
    if tuple(norm.weight.shape) != shape:
        raise ValueError(f"its {name}.weight is {tuple(norm.weight.shape)}, not {list(shape)}")
    return f"{name}.weight", float(norm.eps)
