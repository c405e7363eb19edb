"""Make a model context-parallel in place: swap its attention cores, offset its positions.

A model qualifies when its attention calls a parameter-free core module on (batch, heads,
seq, head_dim) q, k, v (the reference GPT's ``layers.*.attn.core``), and its learned
position embedding is a module called with the position ids of the local sequence
(``embed.pos``). ``context_parallelize`` replaces each core by a ``ContextParallelAttention``
(ring or Ulysses) and makes the position module look up this rank's global positions. The
weights are untouched; everything else in the model works per token and needs no change.
"""

from __future__ import annotations

from enum import StrEnum
from functools import partial
from typing import Any

from torch import Tensor, nn

from tessera.comm import Group, group_rank, group_size
from tessera.tensor_parallel.context.layout import Layout, local_positions
from tessera.tensor_parallel.context.ring import ring_attention
from tessera.tensor_parallel.context.ulysses import check_ulysses, ulysses_attention
from tessera.tensor_parallel.plan import match_pattern

__all__ = ["ContextParallelAttention", "Mode", "context_parallelize"]


class Mode(StrEnum):
    """How attention sees the whole sequence: K/V around a ring, or all-to-all to heads."""

    RING = "ring"
    ULYSSES = "ulysses"


class ContextParallelAttention(nn.Module):
    """An attention core over a sequence split across ``group``: ring or Ulysses attention."""

    def __init__(
        self,
        group: Group,
        *,
        mode: Mode | str = Mode.RING,
        layout: Layout | str = Layout.CONTIGUOUS,
        causal: bool = True,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.group, self.mode, self.layout = group, Mode(mode), Layout(layout)
        self.causal, self.scale = causal, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        fn = ring_attention if self.mode is Mode.RING else ulysses_attention
        return fn(q, k, v, group=self.group, causal=self.causal, layout=self.layout, scale=self.scale)

    def extra_repr(self) -> str:
        return f"mode={self.mode.value}, layout={self.layout.value}, causal={self.causal}"


def _offset_positions(
    module: nn.Module, args: tuple[Any, ...], *, sp: int, rank: int, layout: Layout
) -> tuple[Any, ...]:
    """Forward pre-hook: position ids ``0..local_len-1`` become this rank's global positions."""
    ids: Tensor = args[0]
    table = local_positions(rank, sp, ids.shape[-1], layout, ids.device)
    return (table[ids], *args[1:])


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    found = [(n, m) for n, m in model.named_modules() if n and match_pattern(pattern, n)]
    if not found:
        raise ValueError(
            f"context_parallelize: pattern {pattern!r} matches no module of {type(model).__name__}"
        )
    return found


def _check_core(name: str, core: nn.Module, mode: Mode, sp: int, heads: int | None) -> None:
    if any(True for _ in core.parameters()):
        raise ValueError(f"attention core {name} has parameters; only a parameter-free core can be swapped")
    if float(getattr(core, "dropout", 0.0)) > 0:
        raise ValueError(
            f"attention core {name} has dropout {core.dropout}; context parallelism does not support it"
        )
    if mode is Mode.ULYSSES and heads is not None:
        check_ulysses(heads, heads, sp)


def context_parallelize(
    model: nn.Module,
    group: Group,
    *,
    mode: Mode | str = Mode.RING,
    layout: Layout | str = Layout.CONTIGUOUS,
    cores: str = "layers.*.attn.core",
    positions: str | None = "embed.pos",
    heads: int | None = None,
) -> nn.Module:
    """Make ``model`` run on this rank's slice of the sequence (``layout``) over ``group``.

    Each module matching ``cores`` (plan-style dotted pattern) is replaced by a
    ``ContextParallelAttention`` with its ``causal`` flag (default True) and ``scale`` (if
    any); the module matching ``positions`` (None: none) gets a forward pre-hook mapping
    local position ids to this rank's global positions. ``heads``, when given, is checked
    against ``sp`` for Ulysses up front (the cores check the shapes they see anyway).
    Everything is checked before the model changes; returns the model. Feed it this rank's
    slice of each batch (``split_batch``), reduce the loss with ``context_parallel_loss``
    and sum the gradients over ``group`` (``sync_context_parallel_grads``).
    """
    mode, layout = Mode(mode), Layout(layout)
    sp, rank = group_size(group), group_rank(group)
    found = _matching(model, cores)
    for name, core in found:
        _check_core(name, core, mode, sp, heads)
    position_modules = _matching(model, positions) if positions is not None else []
    for name, core in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        cp = ContextParallelAttention(
            group,
            mode=mode,
            layout=layout,
            causal=bool(getattr(core, "causal", True)),
            scale=getattr(core, "scale", None),
        )
        setattr(parent, child, cp)
    for _, module in position_modules:
        module.register_forward_pre_hook(partial(_offset_positions, sp=sp, rank=rank, layout=layout))
    return model
