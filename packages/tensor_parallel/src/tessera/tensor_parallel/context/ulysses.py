"""Ulysses (DeepSpeed) attention: all-to-all from sequence-split to head-split and back.

Each rank enters with q, k, v for its slice of the sequence and all heads; one all-to-all
each turns them into the whole sequence for ``1/cp`` of the heads (and of the K/V heads),
attention runs locally, and one all-to-all turns the output back. Forward moves four
all-to-alls of the activations (q, k, v, out); backward four more (their gradients).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.comm import Group, all_to_all_along, group_size
from tessera.tensor_parallel.context.layout import Layout, local_positions
from tessera.tensor_parallel.context.ring import check_heads, check_window

__all__ = ["check_ulysses", "ulysses_attention"]


def check_ulysses(heads: int, kv_heads: int, cp: int) -> None:
    """ValueError unless ``cp`` divides both ``heads`` and ``kv_heads`` (pure)."""
    if heads % cp or kv_heads % cp:
        raise ValueError(
            f"Ulysses attention needs heads={heads} and kv heads={kv_heads} divisible by cp={cp}"
        )


def _gathered_positions(cp: int, local_len: int, layout: Layout, device: torch.device) -> Tensor:
    """Global positions of the sequence as the all-to-all concatenates it: rank 0's, rank 1's, ..."""
    return torch.cat([local_positions(r, cp, local_len, layout, device) for r in range(cp)])


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Group,
    causal: bool = True,
    layout: Layout | str = Layout.CONTIGUOUS,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention of this rank's slice of the sequence, computed head-split after an all-to-all.

    Shapes as ``ring_attention``: q (batch, heads, local_seq, head_dim), k and v (batch,
    kv_heads, local_seq, head_dim). ``heads`` and ``kv_heads`` must divide by the group size
    (checked before any communication). ``window``: sliding-window causal attention, as
    ``ring_attention``'s (here a mask over the gathered sequence). Moves 4 all-to-alls
    forward, 4 backward.
    """
    groups = check_heads(q, k, v)
    check_window(window, causal)
    cp = group_size(group)
    check_ulysses(q.shape[1], k.shape[1], cp)
    local_len = q.shape[2]
    qh, kh, vh = (all_to_all_along(t, 1, 2, group) for t in (q, k, v))  # (b, h/cp, seq, d)
    if groups > 1:
        kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    pos = _gathered_positions(cp, local_len, Layout(layout), q.device)
    order = torch.argsort(pos)
    shuffled = causal and bool((order != torch.arange(pos.numel(), device=pos.device)).any())
    if shuffled:  # put the gathered sequence in position order: causal is then is_causal=True,
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))  # no seq x seq mask saved
    if window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    else:  # in position order: the window's mask is a band below the diagonal
        ordered = torch.arange(pos.numel(), device=q.device)
        back = ordered[:, None] - ordered[None, :]
        band = (back >= 0) & (back < window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=band, scale=scale)
    if shuffled:
        out = out.index_select(2, torch.argsort(order))
    return all_to_all_along(out, 2, 1, group)
