"""Every rank must start from the same model, checked before anything is split.

``boost()`` splits the model each rank built: a parameter drawn at random on each rank without
a common seed (the user's own init, or the adapters ``peft.get_peft_model`` adds) would give
every rank a different model, and training would silently follow none of them. ``torch``'s DDP
hides this by broadcasting rank 0's weights; here it is named instead, before any rank changes
anything: each parameter's sum and sum of magnitudes (float64) are compared over every rank.
The same tensor sums alike everywhere up to the order of a reduction (another CPU's kernels):
relative 1e-6 is allowed; weights drawn apart differ by about their own size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_same_start"]

_RTOL = 1e-6
_PIECE = 1 << 20  # elements summed at once: a float64 copy of one piece, not of a whole embedding


def _sums(p: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of magnitudes]`` of ``p`` in float64, a piece at a time (a float64 copy of a
    large parameter would cost 8 bytes per element for a moment: 4x a bf16 model)."""
    flat = p.detach().reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=p.device)
    for start in range(0, flat.numel(), _PIECE):
        piece = flat[start : start + _PIECE]
        wide = piece.double()
        total += torch.stack([wide.sum(), wide.abs().sum()])
    return total


def check_same_start(model: nn.Module, device: torch.device) -> None:
    """ValueError on every rank, naming the parameters, unless every rank's ``model`` holds the
    same values (parameters on the meta device are skipped: a deferred model has none yet).
    Collective over the default group: one all-reduce of 4 float64 numbers per parameter."""
    named = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    if not named:
        return
    with torch.no_grad():
        local = torch.stack([_sums(p) for _, p in named]).to(device)
    both = torch.cat([local, -local])  # one max over every rank gives the highest and the lowest
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # torch's own: nothing of Tessera's set up for the world
    high, low = both[: len(named)], -both[len(named) :]
    scale = high[:, 1].abs().clamp_min(1e-30)
    spread = ((high - low).abs().max(dim=1).values / scale).cpu()
    differ = [name for (name, _), s in zip(named, spread.tolist(), strict=True) if s > _RTOL]
    if differ:
        raise ValueError(
            f"boost: the model differs across ranks before training ({len(differ)} of {len(named)} "
            f"parameters, e.g. {', '.join(differ[:4])}): build it the same way on every rank, seeding "
            "the random generator first (torch.manual_seed) where weights or adapters "
            "(peft.get_peft_model) are drawn at random"
        )
