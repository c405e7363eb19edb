"""RMS norms inside a mixture-of-experts layer: of each expert's output, and of the layer's.

``rms_normed(x, weight, eps)`` is ``weight * x / sqrt(mean(x**2) + eps)`` over the last dim,
computed in fp32 and cast back to ``x``'s dtype before the weight multiplies (the weight in its
own dtype, as Hugging Face's RMS norms do).

- **Per-expert output norms** (`tessera.moe.Experts` with ``norm_eps``, Ergo's
  ``post_expert_norm``): a bank holds ``norm [n, d]``, ones at first, and normalises each
  expert's output rows with that expert's own row of it, before the router's weight applies.
  The weight lives with its expert: split over ep with the bank (``Experts.keep``). A norm
  needs each row's whole output, so a bank with one cannot be split inside over tp, where each
  rank holds a partial sum of every output (`norm_split_problem`; ``split_hidden`` and the
  launcher's ``moe`` style refuse it, and a layer that keeps it whole runs on every tp rank).
  A shared expert bank may hold one too (Ergo's shared expert ends in an RMS norm).
- **A post-norm of the layer's output** (`MoE`'s ``post_norm_eps``, AXK1): applied after the
  tp region, to whole tokens (`post_normed`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tessera.comm import Group, group_rank

__all__ = ["norm_split_problem", "normalised", "post_normed", "rms_normed"]


def normalised(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps)``, computed in fp32, in ``x``'s dtype."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_normed(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)``, normalised in fp32 (module docstring)."""
    return weight * normalised(x, eps)


def norm_split_problem(banks: dict[str, bool]) -> str:
    """Why banks named in ``banks`` (name -> whether it normalises its experts' outputs) cannot
    have their hidden units split over tp ("" when none normalises)."""
    normed = [name for name, has in banks.items() if has]
    if not normed:
        return ""
    return (
        f"the {' and '.join(normed)} bank normalises each expert's output (per-expert RMS norm), which needs "
        "the whole output of every expert: a split over tp leaves each rank a partial sum of it; keep the "
        "layer whole at tp (the 'replicate' style) or split it over ep"
    )


def post_normed(out: Tensor, weight: Tensor, eps: float, group: Group | None, whole: bool, tp: int) -> Tensor:
    """The layer's output ``out`` RMS-normalised and scaled by ``weight`` (`rms_normed`). Where
    every one of the ``tp`` ranks of ``group`` holds the same ``whole`` output, the weight's
    gradient on each rank comes from its own share of the tokens (every ``tp``-th row from its
    rank on), so that the sum over tp, which the weight's partial gradient takes, counts each
    token once; else (one rank, or each rank its own slice of the sequence) it applies as it is."""
    if tp == 1 or not whole:
        return rms_normed(out, weight, eps)
    rows = normalised(out, eps).reshape(-1, out.shape[-1])
    mine = torch.zeros(rows.shape[0], 1, dtype=torch.bool, device=rows.device)
    mine[group_rank(group) :: tp] = True
    return (torch.where(mine, weight, weight.detach()) * rows).view(out.shape)
