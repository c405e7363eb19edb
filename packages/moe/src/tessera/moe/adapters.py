"""Low-rank adapters (LoRA) on a mixture's experts and router: frozen weights, trained deltas.

An adapter adds ``scaling * B @ A`` (rank r) to a weight in the orientation of a linear map
``out x in``; the layer computes with the sum, so the weights themselves may stay frozen.

- ``ExpertAdapter``, on a bank (`Experts.adapters`), one per expert stacked: ``down [n, r, in]``
  and one up projection per weight it changes, ``up[w] [n, out, r]``. At the bank's input
  (``site="in"``) it changes ``w1`` and/or ``w3`` (in = d, out = h; one ``down`` shared by both
  ups, as an adapter on a fused gate|up weight is); at its output (``site="out"``) ``w2`` (in =
  h, out = d). ``keep`` (expert parallelism) keeps its experts' slices of every tensor;
  ``keep_hidden`` (tensor parallelism inside the experts) keeps the hidden units the bank
  keeps: the rows of ``up[w1/w3]``, the columns of an ``out`` adapter's ``down``. The parts
  that stay whole there (an ``in`` adapter's ``down``, an ``out`` adapter's ``up``) see every
  hidden unit through this rank's share only: their gradients are partial over tp and summed
  as every whole parameter inside the layer's region is.
- ``RouterAdapter``, on a router (`TopKRouter.adapters`): ``down [r, d]``, ``up [E, r]``; whole
  on every rank, as the router is.

Under expert parallelism an expert's adapter lives and trains with its expert
(`expert_parameters` lists it: its gradient is summed over the expert-data-parallel group).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = ["ExpertAdapter", "RouterAdapter", "Site", "deltas"]

Site = Literal["in", "out"]
_TARGETS: dict[str, tuple[str, ...]] = {"in": ("w1", "w3"), "out": ("w2",)}


class ExpertAdapter(nn.Module):
    """Per-expert ``scaling * up[w] @ down`` added to weight ``w`` of a bank (module docstring).
    ``down [n, r, in]``, ``up[w] [n, out, r]``; ``w`` in ``w1``/``w3`` (``site="in"``) or
    ``w2`` (``site="out"``)."""

    def __init__(self, down: Tensor, up: dict[str, Tensor], *, site: Site, scaling: float) -> None:
        super().__init__()
        if site not in _TARGETS or not up or not set(up) <= set(_TARGETS[site]):
            raise ValueError(
                f"an expert adapter at site {site!r} changes {_TARGETS.get(site, ())}, got {sorted(up)}"
            )
        n, r, _ = down.shape
        for w, u in up.items():
            if u.dim() != 3 or u.shape[0] != n or u.shape[2] != r:
                raise ValueError(f"up[{w}] must be [n={n}, out, r={r}], got {tuple(u.shape)}")
        self.site: Site = site
        self.scaling = float(scaling)
        self.down = nn.Parameter(down)
        self.up = nn.ParameterDict({w: nn.Parameter(u) for w, u in up.items()})

    def delta(self, w: str) -> Tensor | None:
        """The change of bank weight ``w`` in the bank's layout ``[n, in, out]`` (None: not
        changed by this adapter)."""
        if w not in self.up:
            return None
        up: Tensor = self.up[w]
        return (up @ self.down).transpose(1, 2) * self.scaling

    def keep(self, start: int, stop: int) -> None:
        """Keep experts ``start:stop`` (copies, trained where they were)."""
        self.down = _part(self.down, 0, start, stop)
        for w in list(self.up):
            self.up[w] = _part(self.up[w], 0, start, stop)

    def keep_hidden(self, start: int, stop: int) -> None:
        """Keep hidden units ``start:stop`` of every expert, as the bank keeps them."""
        if self.site == "in":
            for w in list(self.up):
                self.up[w] = _part(self.up[w], 1, start, stop)
        else:
            self.down = _part(self.down, 2, start, stop)


class RouterAdapter(nn.Module):
    """``scaling * up @ down`` added to a router's ``weight [E, d]``: ``down [r, d]``, ``up [E, r]``."""

    def __init__(self, down: Tensor, up: Tensor, *, scaling: float) -> None:
        super().__init__()
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            raise ValueError(
                f"a router adapter needs down [r, d] and up [E, r], got {down.shape}, {up.shape}"
            )
        self.scaling = float(scaling)
        self.down = nn.Parameter(down)
        self.up = nn.Parameter(up)

    def delta(self) -> Tensor:
        """The change of the router's ``weight [E, d]``."""
        return (self.up @ self.down) * self.scaling


def deltas(weight: Tensor, changes: Iterable[Tensor | None]) -> Tensor:
    """``weight`` plus every change that is not None (``weight`` itself when none is)."""
    out = weight
    for change in changes:
        if change is not None:
            out = out + change.to(weight.dtype)
    return out


def _part(p: nn.Parameter, dim: int, start: int, stop: int) -> nn.Parameter:
    with torch.no_grad():
        part = p.detach().narrow(dim, start, stop - start).clone()
    return nn.Parameter(part, requires_grad=p.requires_grad)
